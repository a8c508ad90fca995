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

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,) absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) KV slot = block_id * block_size + offset
    num_decode: int  # decode rows = the first num_decode tokens and sequences
    block_tables: torch.Tensor  # (S, max_blocks) KV block ids per sequence
    seq_lens: torch.Tensor  # (S,) context length including this step's tokens
    state_slots: torch.Tensor  # (S,) live recurrent state slot per sequence
    prefill_cu_seqlens: torch.Tensor  # (S - num_decode + 1,) offsets inside the prefill tokens
    prefill_initial_slots: torch.Tensor  # (S - num_decode,) -1 where a sequence starts at 0
    logits_indices: torch.Tensor  # (R,) rows of the hidden states whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's K and V caches: per-layer views for the kernels, and the pool and
    layer index for code that must not write through a view (the compiled decode step)."""

    key: torch.Tensor  # (num_blocks, kv_heads, block_size, head_dim), a strided view
    value: torch.Tensor
    pool: torch.Tensor  # StateCaches.kv
    layer: int


@dataclass(frozen=True)
class RecurrentLayer:
    """One recurrent layer's state tensors (its kind's names: conv, ssm / recurrent, ...), as
    per-layer views and as (pool, layer) for code that must write the pool in place."""

    views: dict[str, torch.Tensor]  # name -> (num_slots, *local shape), a strided view
    pools: dict[str, torch.Tensor]  # name -> StateCaches.state[name]
    layer: int


@dataclass
class StateCaches:
    """Device memory for attention KV blocks and recurrent state slots, block- and slot-major.

    A block (or a slot of one state tensor) is one contiguous region across all layers, which
    is what the transceiver moves; per-layer views are strided.
    """

    kv: torch.Tensor | None  # (num_blocks, num_attn_layers, 2, kv_heads, block_size, head_dim)
    # Per state tensor of the model's recurrent kind (models/recurrent_state.py), in its order:
    # (num_slots, num_recurrent_layers, *local shape).
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def kv_layer(self, index: int) -> KVLayer:
        assert self.kv is not None
        # The last plane is V; a latent cache has one plane, its V being its K.
        return KVLayer(self.kv[:, index, 0], self.kv[:, index, -1], self.kv, index)

    def recurrent_layer(self, index: int) -> RecurrentLayer:
        views = {name: pool[:, index] for name, pool in self.state.items()}
        return RecurrentLayer(views, self.state, index)

    def pools(self) -> dict[str, torch.Tensor]:
        """Every pool by transfer region kind: "kv" and the state tensors' names."""
        return ({"kv": self.kv} if self.kv is not None else {}) | self.state
