"""What one engine's transferable state looks like, and whether two engines can exchange it.

Both sides of a transfer describe their pools with a `PeerLayout` (exchanged once per peer) and
reject a peer whose compatibility hash differs: same model, dtypes (the SSM state dtype too),
block size, layer layout and head geometry, with tensor-parallel sizes dividing each other.

Pool layouts (one block / slot is one contiguous region on each rank):
    KV:    (num_blocks, attn_layers, 2, kv_heads_per_rank, block_size, head_dim)
    conv:  (num_slots, mamba_layers, conv_rows_per_rank, conv_kernel - 1)
           conv rows = x (intermediate / tp) | B (groups_per_rank * state) | C (same)
    ssm:   (num_slots, mamba_layers, heads_per_rank, head_dim, state_size)

KV heads and B/C groups are replicated when there are fewer than ranks (one per rank), so the
model's totals travel too (`num_kv_heads`, `mamba_groups`): per-rank sizes times tp would
overcount them. See docs/tensor-parallel.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import msgpack


@dataclass(frozen=True)
class PeerLayout:
    model_id: str  # a digest of the model's config (same weights assumed)
    tp_size: int
    tp_rank: int
    layer_kinds: tuple[str, ...]  # every sublayer: mamba / attention / mlp / moe
    # Attention (kv_heads_per_layer holds 0 for non-attention layers, the HF convention).
    kv_heads_per_layer: tuple[int, ...]
    num_kv_heads: int  # the model's, across ranks
    block_size: int
    head_dim: int
    kv_dtype: str
    # Mamba, per rank.
    conv_sections: tuple[int, int, int]  # rows of x | B | C on this rank
    mamba_groups: int  # the model's n_groups, across ranks
    conv_width: int  # conv_kernel - 1 (the stored window)
    conv_dtype: str
    ssm_heads: int
    ssm_head_dim: int
    ssm_state_size: int
    ssm_dtype: str

    @property
    def kv_heads_per_rank(self) -> int:
        """The first non-zero per-layer count (layer 0 of a hybrid is often Mamba)."""
        return next((h for h in self.kv_heads_per_layer if h), 0)

    @property
    def num_attention_layers(self) -> int:
        return sum(1 for h in self.kv_heads_per_layer if h)

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_kinds.count("mamba")

    def full_geometry(self) -> dict[str, Any]:
        """The rank-independent shape: what two peers of any TP sizes must agree on."""
        tp = self.tp_size
        return {
            "model_id": self.model_id,
            "layer_kinds": list(self.layer_kinds),
            "kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_dim": self.head_dim,
            "kv_dtype": self.kv_dtype,
            "conv_sections": [
                self.conv_sections[0] * tp,
                self.mamba_groups * self.ssm_state_size,
                self.mamba_groups * self.ssm_state_size,
            ],
            "conv_width": self.conv_width,
            "conv_dtype": self.conv_dtype,
            "ssm_heads": self.ssm_heads * tp,
            "ssm_head_dim": self.ssm_head_dim,
            "ssm_state_size": self.ssm_state_size,
            "ssm_dtype": self.ssm_dtype,
        }

    def compatibility_hash(self) -> str:
        """Equal on two peers that can exchange state (TP sizes aside)."""
        canonical = msgpack.packb(self.full_geometry(), use_bin_type=True)
        return hashlib.sha256(canonical).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerLayout:
        fields = dict(data)
        for key in ("layer_kinds", "kv_heads_per_layer", "conv_sections"):
            fields[key] = tuple(fields[key])
        return cls(**fields)


class LayoutMismatch(ValueError):
    """Two engines cannot exchange state; the message says which field differs."""


def check_compatible(local: PeerLayout, peer: PeerLayout) -> None:
    if local.compatibility_hash() == peer.compatibility_hash() and _tp_divides(local, peer):
        return
    mine, theirs = local.full_geometry(), peer.full_geometry()
    diffs = [f"{k}: local {mine[k]!r} vs peer {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
    if not _tp_divides(local, peer):
        diffs.append(
            f"tensor_parallel_size {local.tp_size} vs {peer.tp_size}: one must divide the other"
        )
    raise LayoutMismatch("peer layout is incompatible (" + "; ".join(diffs) + ")")


def _tp_divides(a: PeerLayout, b: PeerLayout) -> bool:
    big, small = max(a.tp_size, b.tp_size), min(a.tp_size, b.tp_size)
    return big % small == 0
