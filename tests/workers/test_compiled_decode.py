"""The compiled decode step around the compiler: its failure leaves the engine eager and
exact, and configurations it cannot serve are refused. (Its outputs against transformers:
tests/workers/test_parity.py::test_compiled_decode_matches_transformers.) The native
one-request step is off where a test needs the compiled one-row graph to run."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.workers import LLM, EngineConfig, SamplingParams
from hybridserve.workers import compiled_decode as compiled_decode_module
from tests.helpers import (
    assert_pools_at_baseline,
    make_hf_model,
    random_prompts,
    save_hf_checkpoint,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_a_compiler_failure_leaves_every_step_eager_and_exact(monkeypatch, caplog):
    prompts = random_prompts([3, 17, 40], seed=3)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]

    def no_compiler(*args, **kwargs):
        def compiled(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return compiled

    monkeypatch.setattr(compiled_decode_module.torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger=compiled_decode_module.__name__):
        llm = LLM("tiny", compile_decode=True)
    assert "compiling failed, decode runs eagerly (no C++ compiler found)" in caplog.text
    compiled = llm.engine.executor.driver.compiled_decode
    assert not compiled.enabled

    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert compiled.num_compiled_steps == 0
    assert_pools_at_baseline(llm.engine)


def test_compile_decode_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="compile_decode runs at tensor_parallel_size 1, not 2"):
        EngineConfig(compile_decode=True, tensor_parallel_size=2)


def test_the_warm_up_compiles_every_graph_a_decode_step_needs():
    """Tables of one to five blocks, four rows and one: no step recompiles. (The first request
    longer than two blocks once recompiled the step for 12 s: the tracer had tied the table
    width to the KV pool's number of attention layers, both 2 in the warm-up.)"""
    prompts = random_prompts([3, 17, 40, 70], seed=5)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
    llm = LLM("tiny", compile_decode=True, native_decode=False)
    compiled = llm.engine.executor.driver.compiled_decode
    assert compiled.enabled
    with torch.compiler.set_stance("fail_on_recompile"):
        together = llm.generate(prompts, GREEDY)
        alone = llm.generate(prompts[3:], GREEDY)
    assert [o.token_ids for o in together] == expected
    assert alone[0].token_ids == expected[3]
    assert compiled.num_compiled_steps >= 2 * (GREEDY.max_tokens - 1)
    assert_pools_at_baseline(llm.engine)


def test_engines_of_one_model_class_never_share_graphs(tmp_path):
    """Two compiled Bamba engines whose models differ only in their MLP width (the pools and
    batches look alike), taking turns in one process: each gives its eager tokens. The compiled
    step does not check the model's attributes before a call, so this holds only because each
    engine compiles a function of its own."""
    prompts = random_prompts([5, 30], seed=11)
    engines = []
    for width in (96, 160):
        folder = save_hf_checkpoint(
            make_hf_model("bamba", intermediate_size=width), tmp_path / str(width)
        )
        expected = [o.token_ids for o in LLM(str(folder)).generate(prompts, GREEDY)]
        engines.append((LLM(str(folder), compile_decode=True, native_decode=False), expected))
    for _ in range(2):
        for llm, expected in engines:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    for llm, _ in engines:
        assert llm.engine.executor.driver.compiled_decode.num_compiled_steps > 0
        assert_pools_at_baseline(llm.engine)
