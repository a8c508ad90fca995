"""The CPU decode-attention kernel against the torch reference, eager and in the compiled step."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve import kernels
from hybridserve.kernels import dispatch
from hybridserve.kernels.cpu import attention, ops
from hybridserve.kernels.reference import paged_attention_decode_ref

BLOCKS, LAYERS, LAYER, HKV, BLOCK_SIZE, D, H = 12, 2, 1, 2, 4, 16, 6
# Context lengths: one token, a partial block, whole blocks, a padding row (0), the longest.
SEQ_LENS = [1, 6, 8, 0, 17]
SCALE = 1 / math.sqrt(D)


def make_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, KV pool, block tables): shuffled block ids, columns past a row's blocks -1."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(BLOCKS, LAYERS, 2, HKV, BLOCK_SIZE, D, generator=gen)
    width = -(-max(SEQ_LENS) // BLOCK_SIZE) + 1
    tables = torch.full((len(SEQ_LENS), width), -1)
    for row, length in enumerate(SEQ_LENS):
        used = -(-length // BLOCK_SIZE)
        tables[row, :used] = torch.randperm(BLOCKS, generator=gen)[:used]
    # q is a column slice of a wider projection in the model: not contiguous.
    q = torch.randn(len(SEQ_LENS), H, D + 2, generator=gen)[:, :, 1 : D + 1]
    return q, pool, tables


def reference(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    return paged_attention_decode_ref(
        q,
        pool[:, LAYER, 0],
        pool[:, LAYER, 1],
        block_tables=tables.clamp(min=0),
        seq_lens=torch.tensor(SEQ_LENS),
        scale=SCALE,
    )


def test_the_kernel_is_built_here():
    # CI has a C compiler (the compiled decode step needs one too): a missing kernel is a bug.
    assert attention.build()


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_matches_the_reference_and_zeroes_padding_rows(seed):
    q, pool, tables = make_inputs(seed)
    out = attention.paged_attention_decode(
        q,
        pool[:, LAYER, 0],
        pool[:, LAYER, 1],
        block_tables=tables,
        seq_lens=torch.tensor(SEQ_LENS),
        scale=SCALE,
    )
    torch.testing.assert_close(out, reference(q, pool, tables), rtol=1e-5, atol=1e-5)
    assert not out[SEQ_LENS.index(0)].any(), "a row without context outputs zeros"


def test_the_operator_matches_the_reference():
    """`ops.attention_decode` (C++ calling the kernel) on (pool, layer)."""
    assert ops.build()
    q, pool, tables = make_inputs(5)
    out = ops.attention_decode(q, pool, LAYER, tables, torch.tensor(SEQ_LENS), SCALE)
    torch.testing.assert_close(out, reference(q, pool, tables), rtol=1e-5, atol=1e-5)
    assert not out[SEQ_LENS.index(0)].any(), "a row without context outputs zeros"


def test_cpu_tensors_dispatch_to_the_kernel(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    calls = []
    kernel = attention.paged_attention_decode
    monkeypatch.setattr(
        attention,
        "paged_attention_decode",
        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
    )
    monkeypatch.setattr(dispatch, "implementation", dispatch.implementation.__wrapped__)
    q, pool, tables = make_inputs(2)
    out = kernels.paged_attention_decode(
        q,
        pool[:, LAYER, 0],
        pool[:, LAYER, 1],
        block_tables=tables,
        seq_lens=torch.tensor(SEQ_LENS),
        scale=SCALE,
    )
    assert calls == [1]
    torch.testing.assert_close(out, reference(q, pool, tables), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_compiled_step_attends_through_the_kernel():
    """`attention_decode_pooled` compiled (the operator is opaque to the compiler; its C++
    calls the kernel) against the reference on the layer's view."""
    assert ops.build()
    q, pool, tables = make_inputs(3)
    real = [i for i, n in enumerate(SEQ_LENS) if n > 0]  # the compiled step has no padding
    q, tables = q[real], tables[real].clamp(min=0)
    seq_lens = torch.tensor([SEQ_LENS[i] for i in real])
    compiled = torch.compile(kernels.attention_decode_pooled, dynamic=True, fullgraph=True)
    options = {"block_tables": tables, "seq_lens": seq_lens, "scale": SCALE}
    out = compiled(q, pool, LAYER, **options)

    expected = paged_attention_decode_ref(q, pool[:, LAYER, 0], pool[:, LAYER, 1], **options)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bf16_caches_run_the_reference():
    q, pool, tables = make_inputs(4)
    pool, q = pool.bfloat16(), q.bfloat16()
    assert not attention.available(pool)
    out = attention.paged_attention_decode(
        q,
        pool[:, LAYER, 0],
        pool[:, LAYER, 1],
        block_tables=tables.clamp(min=0),
        seq_lens=torch.tensor(SEQ_LENS),
        scale=SCALE,
    )
    assert torch.equal(out, reference(q, pool, tables))
