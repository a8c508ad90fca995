"""Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) and Kimi Delta Attention: in_proj ->
causal conv over q|k|v -> gated delta rule -> per-head RMSNorm gated by z -> out_proj.

    in_proj rows:     q (key_dim) | k (key_dim) | v (value_dim) | z (value_dim)
    in_proj_ba rows:  b (Hv) | a (Hv)
    beta = sigmoid(b),   g = -exp(A_log) * softplus(a + dt_bias)   (per value head)

Kimi Delta Attention (`per_channel_decay`) decays each key channel on its own and gates the
output through a sigmoid, both from low-rank projections (layers/low_rank.py):

    in_proj rows:     q | k | v;     b_proj rows: b (Hv);     z = gate(x)
    g = -exp(A_log) * softplus(forget(x) + dt_bias)             (per value head and key channel)

The two are separate layers because FP8 checkpoints quantize the first and keep the second
(small, and feeding the decay) in bfloat16: one fused matrix of both could not stay FP8.

State per sequence lives in a state slot (this layer's conv window over q|k|v and its
(Hv, Dk, Dv) key x value state: the `gdn` kind of models/recurrent_state.py). Decode rows
advance it by one token; prefill sequences run the varlen conv and the chunked delta rule,
starting from zero (first chunk) or from the live slot (every later chunk).

Under tensor parallelism each rank holds 1/tp of the value heads (v, z, b, a, dt_bias, A_log,
the v conv channels, the state). Each key head serves a run of Hv / Hk consecutive value heads:
with at least as many key heads as ranks they are split too; with fewer, each rank holds the one
key head its value heads read (replicated over tp / Hk ranks). The norm is per value head, so
always whole on a rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import gated_delta_chunk, gated_delta_update_pooled, rms_norm
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.causal_conv import causal_conv
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_shard,
    new_param,
    section_ranges,
)
from hybridserve.workers.layers.low_rank import LowRankAdapter
from hybridserve.workers.models.config import GatedDeltaNetSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, RecurrentLayer


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        spec: GatedDeltaNetSpec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        key_dim, value_dim, value_heads = spec.key_dim, spec.value_dim, spec.num_value_heads
        self.num_value_heads = parallel.split(value_heads, "linear_num_value_heads")
        self.value_dim = self.num_value_heads * spec.value_head_dim
        key_rows = parallel.piece(key_dim, spec.num_key_heads)  # this rank's q (and k) rows
        self.key_dim = key_rows[1]
        self.num_key_heads = self.key_dim // spec.key_head_dim
        value_rows = (parallel.tp_rank * self.value_dim, self.value_dim)
        head_rows = (parallel.tp_rank * self.num_value_heads, self.num_value_heads)

        # conv channels: q | k | v; in_proj rows: q | k | v | z; in_proj_ba rows: b | a.
        qkv = [(key_rows, key_dim), (key_rows, key_dim), (value_rows, value_dim)]
        conv_rows = section_ranges(qkv)
        self.conv_dim = 2 * self.key_dim + self.value_dim
        gate = [] if spec.per_channel_decay else [(value_rows, value_dim)]
        self.in_proj = ColumnParallelLinear(
            hidden_size, section_ranges([*qkv, *gate]), False, dtype, device
        )
        ba = [(head_rows, value_heads)] * (1 if spec.per_channel_decay else 2)
        self.in_proj_ba = ColumnParallelLinear(
            hidden_size, section_ranges(ba), False, dtype, device
        )
        decays = self.num_value_heads  # per value head, or per value head and key channel
        self.gate: LowRankAdapter | None = None
        self.forget: LowRankAdapter | None = None
        if spec.per_channel_decay:
            decays *= spec.key_head_dim
            decay_rows = [(parallel.tp_rank * decays, decays)]
            rank = spec.key_head_dim
            self.gate = LowRankAdapter(hidden_size, rank, [value_rows], dtype, device)
            self.forget = LowRankAdapter(hidden_size, rank, decay_rows, dtype, device)
        self.conv_weight = mark_shard(
            new_param(self.conv_dim, 1, spec.conv_kernel, dtype=dtype, device=device),
            0,
            conv_rows,
        )
        self.dt_bias = mark_shard(
            new_param(decays, dtype=dtype, device=device),
            0,
            [(parallel.tp_rank * decays, decays)],
        )
        self.A_log = mark_shard(
            new_param(self.num_value_heads, dtype=dtype, device=device), 0, [head_rows]
        )
        self.norm_weight = new_param(spec.value_head_dim, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(
            value_dim, hidden_size, False, parallel, dtype, device, name="linear_attn out_proj"
        )

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, state: RecurrentLayer
    ) -> torch.Tensor:
        spec = self.spec
        num_tokens = hidden.shape[0]
        heads, value_head_dim = self.num_value_heads, spec.value_head_dim
        A = torch.exp(self.A_log.float())
        if self.gate is not None and self.forget is not None:  # per-channel decay
            qkv, z, b = self.in_proj(hidden), self.gate(hidden), self.in_proj_ba(hidden)
            decays = self.forget(hidden).float() + self.dt_bias.float()
            g = -A[:, None] * F.softplus(decays.view(num_tokens, heads, spec.key_head_dim))
        else:
            qkv, z = self.in_proj(hidden).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(hidden).split([heads, heads], dim=-1)
            g = -A * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid() if spec.beta_scale == 1.0 else b.sigmoid() * spec.beta_scale
        conv_weight = self.conv_weight[:, 0, :]

        def heads_of(mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
            rows = mixed.shape[0]
            q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return (
                q.reshape(rows, self.num_key_heads, spec.key_head_dim),
                k.reshape(rows, self.num_key_heads, spec.key_head_dim),
                v.reshape(rows, heads, value_head_dim),
            )

        mixed = causal_conv(qkv, conv_weight, None, batch, state, activation="silu")
        nd = batch.num_decode
        outputs = []
        if nd:
            # Through (pool, layer): a step the compiled path traces writes the pool in place.
            outputs.append(
                gated_delta_update_pooled(
                    state.pools["recurrent"],
                    state.layer,
                    *heads_of(mixed[:nd]),
                    g[:nd],
                    beta[:nd],
                    state_slots=batch.state_slots[:nd],
                )
            )
        if num_tokens > nd:
            slots = batch.state_slots[nd:]
            outputs.append(
                gated_delta_chunk(
                    *heads_of(mixed[nd:]),
                    g[nd:],
                    beta[nd:],
                    cu_seqlens=batch.prefill_cu_seqlens,
                    states=state.views["recurrent"],
                    initial_state_slots=batch.prefill_initial_slots,
                    final_state_slots=slots,
                    chunk_size=spec.chunk_size,
                )
            )
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # (T, heads, Dv)
        # Normalised per value head, then gated: RMSNorm(y) * silu(z) (sigmoid(z) for KDA).
        normed = rms_norm(y, self.norm_weight, spec.norm_eps)
        z = z.reshape(num_tokens, heads, value_head_dim).float()
        gate = z.sigmoid() if spec.per_channel_decay else F.silu(z)
        out = (normed.float() * gate).to(hidden.dtype)
        return self.out_proj(out.reshape(num_tokens, self.value_dim))
