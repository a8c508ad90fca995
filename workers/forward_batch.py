"""The tensors one model step reads: a packed batch of sequences and the state caches.

Only `ModelRunner` builds these; layers only read them.

Token layout of a batch (T tokens, S sequences, decode rows first):

    tokens  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    rows      decode rows     prefill sequences
              (1 token each,  (a chunk each; may start at position 0 or
              continuing      continue from the live slot)
              from the slot)

Decode rows use the single-step kernels; prefill sequences use the varlen kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,) absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) KV slot = block_id * block_size + offset
    num_decode: int  # decode rows = the first num_decode tokens and sequences
    block_tables: torch.Tensor  # (S, max_blocks) KV block ids per sequence
    seq_lens: torch.Tensor  # (S,) context length including this step's tokens
    mamba_slots: torch.Tensor  # (S,) live Mamba slot per sequence
    prefill_cu_seqlens: torch.Tensor  # (S - num_decode + 1,) offsets inside the prefill tokens
    prefill_initial_slots: torch.Tensor  # (S - num_decode,) -1 where a sequence starts at 0
    logits_indices: torch.Tensor  # (R,) rows of the hidden states whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StateCaches:
    """Device memory for attention KV blocks and Mamba slots, block- and slot-major.

    A block (or slot) is one contiguous region across all layers, which is what the
    transceiver moves; per-layer views are strided.
    """

    kv: torch.Tensor | None  # (num_blocks, num_attn_layers, 2, kv_heads, block_size, head_dim)
    conv: torch.Tensor | None  # (num_slots, num_mamba_layers, conv_dim, conv_kernel - 1)
    ssm: torch.Tensor | None  # (num_slots, num_mamba_layers, heads, head_dim, state_size)

    def kv_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv is not None
        return self.kv[:, index, 0], self.kv[:, index, 1]

    def mamba_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.conv is not None and self.ssm is not None
        return self.conv[:, index], self.ssm[:, index]
