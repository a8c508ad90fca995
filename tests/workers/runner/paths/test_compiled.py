"""The compiled path around the compiler: its failure drops the path and leaves the engine
eager and exact, and a tensor-parallel engine does not use it. (Its outputs against
transformers: tests/workers/test_parity.py::test_compiled_decode_matches_transformers.) The
native path is left out where a test needs the compiled one-row graph to run."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.runner import model_runner
from hybridserve.workers.runner.paths import compiled as compiled_module
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

    monkeypatch.setattr(compiled_module.torch, "compile", no_compiler)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        llm = LLM("tiny", forward_paths=("native", "compiled", "eager"))
    assert "forward path compiled: off (compiling failed: no C++ compiler found)" in caplog.text
    runner = llm.engine.executor.driver
    assert [path.name for path in runner.paths] == ["native", "eager"]

    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pools_at_baseline(llm.engine)


def test_the_compiled_path_does_not_serve_tensor_parallel_engines():
    runner = SimpleNamespace(parallel=SimpleNamespace(tp_size=2))
    reason = compiled_module.CompiledPath(runner).unsupported()  # type: ignore[arg-type]
    assert reason == "tensor_parallel_size 2 (the compiled step has no collectives)"
    runner.parallel.tp_size = 1
    assert compiled_module.CompiledPath(runner).unsupported() is None  # type: ignore[arg-type]


def test_the_warm_up_compiles_every_graph_a_decode_step_needs():
    """Tables of one to five blocks, four rows and one: no step recompiles. (The first request
    longer than two blocks once recompiled the step for 12 s: the tracer had tied the table
    width to the KV pool's number of attention layers, both 2 in the warm-up.)"""
    prompts = random_prompts([3, 17, 40, 70], seed=5)
    expected = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
    llm = LLM("tiny", forward_paths=("compiled", "eager"))
    compiled = llm.engine.executor.driver.path("compiled")
    assert compiled is not None
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
        engines.append((LLM(str(folder), forward_paths=("compiled", "eager")), expected))
    for _ in range(2):
        for llm, expected in engines:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    for llm, _ in engines:
        assert llm.engine.executor.driver.path("compiled").num_compiled_steps > 0
        assert_pools_at_baseline(llm.engine)
