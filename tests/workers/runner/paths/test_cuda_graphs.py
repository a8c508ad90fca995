"""Decode steps as CUDA graphs: buckets, padding onto the scratch block and slot, replay."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.models.loader import load_model, open_checkpoint
from hybridserve.workers.runner.forward_batch import ForwardBatch
from hybridserve.workers.runner.paths import cuda_graphs
from hybridserve.workers.runner.paths.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    bucket_sizes,
    graphs_unsupported,
)
from tests.helpers import (
    assert_pools_at_baseline,
    make_hf_model,
    random_prompts,
    save_hf_checkpoint,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_buckets_are_1_2_4_then_multiples_of_8_up_to_the_first_one_past_the_limit():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 4]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert bucket_sizes(64)[-3:] == [48, 56, 64]
    assert bucket_sizes(10_000)[-1] == 512


def test_graphs_are_refused_off_cuda_under_tensor_parallelism_and_with_moe(tmp_path):
    cuda = torch.device("cuda")
    tiny = LLM("tiny").engine.executor.driver.model
    assert graphs_unsupported(tiny, torch.device("cpu"), 1) == "not on CUDA"
    assert "tensor_parallel_size 2" in graphs_unsupported(tiny, cuda, 2)
    assert graphs_unsupported(tiny, cuda, 1) is None
    folder = save_hf_checkpoint(make_hf_model("granitemoehybrid"), tmp_path)
    moe = load_model(open_checkpoint(str(folder)), dtype=torch.float32, device="cpu")
    assert "MoE" in graphs_unsupported(moe, cuda, 1)


def test_a_failed_capture_leaves_decode_eager_and_exact(monkeypatch, caplog):
    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "graphs_unsupported", lambda *args: None)
    monkeypatch.setattr(DecodeGraphs, "capture", refuse)
    with caplog.at_level(logging.INFO):
        llm = LLM("tiny", device="cpu")
    assert llm.engine.executor.driver.path("cuda_graphs") is None
    assert "forward path cuda_graphs: off (capture failed: operation not" in caplog.text
    prompts = random_prompts([5, 19, 40], seed=2)
    expected = [o.token_ids for o in LLM("tiny", device="cpu").generate(prompts, GREEDY)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert_pools_at_baseline(llm.engine)


def decode_batch(rows: int, width: int, block_size: int) -> ForwardBatch:
    """`rows` decode rows on slots 1.., `width` blocks per row, at different positions."""
    positions = [5 + 7 * row for row in range(rows)]
    tables = [[width * row + col for col in range(width)] for row in range(rows)]

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(
        input_ids=ints([11 + row for row in range(rows)]),
        positions=ints(positions),
        slot_mapping=ints(
            [
                t[p // block_size] * block_size + p % block_size
                for t, p in zip(tables, positions, strict=True)
            ]
        ),
        num_decode=rows,
        block_tables=ints(tables),
        seq_lens=ints([p + 1 for p in positions]),
        state_slots=ints([1 + row for row in range(rows)]),
        prefill_cu_seqlens=ints([0]),
        prefill_initial_slots=ints([]),
        logits_indices=ints(list(range(rows))),
    )


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory) -> str:
    return str(save_hf_checkpoint(make_hf_model("qwen3_5"), tmp_path_factory.mktemp("qwen")))


@pytest.fixture(params=["tiny", "qwen3_5"])
def model(request) -> str:
    """A Mamba2 hybrid (tiny) or a Gated DeltaNet one."""
    return "tiny" if request.param == "tiny" else request.getfixturevalue("qwen3_5_checkpoint")


@torch.inference_mode()
def test_padding_rows_write_no_state_and_leave_the_rows_unchanged(model):
    """Three rows padded to a bucket of eight through the persistent buffers, on the CPU
    kernels: the rows' hidden states and every pool equal an unpadded step's."""
    runner = LLM(model, device="cpu", block_size=8).engine.executor.driver
    caches = runner.caches
    names = tuple(caches.pools())
    pools = tuple(caches.pools().values())
    generator = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, generator=generator))
    before = [pool.clone() for pool in pools]
    batch = decode_batch(rows=3, width=3, block_size=8)

    unpadded = runner.model(batch, caches)
    unpadded_pools = [pool.clone() for pool in pools]
    for pool, saved in zip(pools, before, strict=True):
        pool.copy_(saved)
    inputs = DecodeInputs(8, max_blocks_per_seq=6, device=runner.device)
    inputs.fill(batch, bucket=8)
    padded = runner.model(inputs.batch(8), caches)

    torch.testing.assert_close(padded[:3], unpadded, rtol=1e-5, atol=1e-5)
    for name, pool, expected in zip(names, pools, unpadded_pools, strict=True):
        torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_equal_eager_steps_as_the_batch_shrinks_through_the_buckets(model):
    """Ten requests finishing at different lengths: decode steps of 10 rows down to 1 replay
    the graphs of buckets 16, 8, 4, 2 and 1, with tables of 1 to 9 blocks; the tokens equal
    an engine that runs every step eagerly."""
    prompts = random_prompts([3, 17, 40, 70, 5, 9, 120, 33, 2, 60], seed=4)
    uneven = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    eager = LLM(model, device="cuda", forward_paths=("eager",))
    expected = [o.token_ids for o in eager.generate(prompts, uneven)]
    llm = LLM(model, device="cuda")
    path = llm.engine.executor.driver.path("cuda_graphs")
    assert path is not None and path.graphs.buckets == bucket_sizes(64)
    graphs = path.graphs
    assert [o.token_ids for o in llm.generate(prompts, uneven)] == expected
    alone = llm.generate(prompts[6:7], GREEDY)[0].token_ids
    assert alone == eager.generate(prompts[6:7], GREEDY)[0].token_ids
    # Every decode-only step replayed a graph: 30 after the prefill step (the longest request
    # has 31 tokens to make), then 11 for the request alone.
    assert graphs.num_replays >= 30 + GREEDY.max_tokens - 1
    assert_pools_at_baseline(llm.engine)
    assert_pools_at_baseline(eager.engine)
