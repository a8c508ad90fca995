"""The decode-step kernels as the compiled decode step traces them (workers/compiled_decode.py).

Same math as `causal_conv1d_update_ref`, `selective_state_update_ref`, `store_kv_ref` and
`paged_attention_decode_ref`, written for `torch.compile`:
- State is addressed as (pool, layer) and written with one `index_put_` on the pool itself. A
  write through a per-layer view of a graph input makes the compiler scatter the view back
  into its base, copying the whole pool every step.
- Nothing waits on the device: no `.item()`, no data-dependent branch (the eager kernels check
  for padding rows and for a contiguous run of slots), so the step is one graph.
Every row is a real request: no slot -1, no padding row (the runner never sends one in a
decode-only batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.kernels import cpu_attention, cpu_ops, cpu_state_update

from ._common import expand_groups, prepare_dt


def _layer_index(rows: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.full_like(rows, layer)


def conv_update_pooled(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_pool: torch.Tensor,
    layer: int,
    state_slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """x: (Bt, C); weight: (C, W); conv_pool: (num_slots, num_layers, C, W - 1), updated in
    place at (state_slots, layer). Returns (Bt, C) in x.dtype."""
    slots = state_slots.long()
    history = conv_pool[slots, layer].float()  # (Bt, C, W - 1)
    window = torch.cat([history, x.float()[:, :, None]], dim=2)  # oldest first, ends at x
    y = (window * weight.float()).sum(dim=-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    conv_pool.index_put_((slots, _layer_index(slots, layer)), window[:, :, 1:].to(conv_pool.dtype))
    return y.to(x.dtype)


def state_update_pooled(
    ssm_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """ssm_pool: (num_slots, num_layers, H, P, N), updated in place at (state_slots, layer);
    x: (Bt, H, P); dt: (Bt, H); A: (H,); B, C: (Bt, G, N). Returns (Bt, H, P) in x.dtype:
    S = exp(dt' * A) * S + dt' * outer(x, B);  y = S @ C + D * x.
    On the CPU with fp32 states, one C kernel pass per state (kernels/cpu_state_update.py,
    called as `cpu_ops.ssm_update_`)."""
    slots = state_slots.long()
    H = x.shape[1]
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (Bt, H)
    if cpu_ops.loaded() and cpu_state_update.available(ssm_pool):
        return cpu_ops.ssm_update_(ssm_pool, layer, x, dt, A, B, C, slots, D).to(x.dtype)
    xf = x.float()
    B, C = expand_groups(B, H), expand_groups(C, H)  # (Bt, H, N)
    states = ssm_pool[slots, layer].float()  # (Bt, H, P, N)
    states = (
        states * torch.exp(dt * A.float())[:, :, None, None]
        + (dt[..., None] * xf)[..., None] * B[:, :, None, :]
    )
    y = (states * C[:, :, None, :]).sum(dim=-1)
    if D is not None:
        y = y + D.float()[:, None] * xf
    ssm_pool.index_put_((slots, _layer_index(slots, layer)), states.to(ssm_pool.dtype))
    return y.to(x.dtype)


def store_kv_pooled(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: (T, Hkv, D); kv_pool: (num_blocks, num_layers, 2, Hkv, block_size, D);
    slot_mapping: (T,) block_id * block_size + offset, every one real."""
    block_size = kv_pool.shape[4]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    layers = _layer_index(blocks, layer)
    for part, tensor in enumerate((key, value)):
        kv_pool[blocks, layers, torch.full_like(blocks, part), :, offsets] = tensor.to(
            kv_pool.dtype
        )


def attention_decode_pooled(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: (Bt, H, D); block_tables: (Bt, max_blocks); seq_lens: (Bt,), each at least 1.
    Returns (Bt, H, D) in q.dtype. Every column of the table is read (its width, not the
    longest row, sets the shape, so the step needs no host sync); columns past a row's own
    last block read block 0 and are masked."""
    if cpu_ops.loaded() and cpu_attention.available(kv_pool):
        out = cpu_ops.attention_decode(q, kv_pool, layer, block_tables, seq_lens, scale)
        return out.to(q.dtype)
    Bt, H, D = q.shape
    Hkv, block_size = kv_pool.shape[3], kv_pool.shape[4]
    num_cols = block_tables.shape[1]
    num_keys = num_cols * block_size
    cols = torch.arange(num_cols, device=q.device)
    row_blocks = (seq_lens + block_size - 1) // block_size
    blocks = torch.where(cols < row_blocks[:, None], block_tables, 0).long().flatten()
    keep = torch.arange(num_keys, device=q.device) < seq_lens[:, None]  # (Bt, num_keys)

    def gather(part: int) -> torch.Tensor:
        rows = kv_pool[blocks, layer, part].view(Bt, num_cols, Hkv, block_size, D)
        return rows.transpose(1, 2).reshape(Bt, Hkv, num_keys, D).float()

    # As in paged_attention_decode_ref: the query heads of one kv head are its "positions".
    out = F.scaled_dot_product_attention(
        q.float().view(Bt, Hkv, H // Hkv, D),
        gather(0),
        gather(1),
        attn_mask=keep[:, None, None, :],
        scale=scale,
    )
    return out.reshape(Bt, H, D).to(q.dtype)
