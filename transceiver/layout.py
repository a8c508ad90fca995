"""What one engine's transferable state looks like, and whether two engines can exchange it.

Both sides of a transfer describe their pools with a `PeerLayout` (exchanged once per peer) and
reject a peer whose compatibility hash differs: same model, dtypes (each state tensor's too),
block size, layer layout and geometry, with tensor-parallel sizes dividing each other.

Pool layouts (one block / slot is one contiguous region on each rank):
    KV:     (num_blocks, attn_layers, kv_planes, kv_heads_per_rank, block_size, head_dim)
            (K and V planes; one plane for a latent cache, whose V is its K)
    state:  one pool per state tensor of the model's recurrent kind (Mamba2: conv, ssm; Gated
            DeltaNet: conv, recurrent), (num_slots, state_layers, rows_per_rank, *row_shape)

A state tensor is described by its sections along the split axis (the model's full sizes and
their units: heads, groups), so each side derives every rank's rows without knowing the layer
kind. KV heads and state units are replicated when there are fewer than ranks (one per rank),
so the model's totals travel (`num_kv_heads`, the sections): per-rank sizes times tp would
overcount them. See docs/tensor-parallel.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import msgpack


def held_rows(size: int, units: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first row, rows) that rank `tp_rank` of `tp_size` holds of `size` rows made of `units`
    units: 1/tp of them with at least as many units as ranks, else one whole unit, shared by
    tp / units ranks."""
    if units >= tp_size:
        rows = size // tp_size
        return tp_rank * rows, rows
    rows = size // units
    return tp_rank // (tp_size // units) * rows, rows


@dataclass(frozen=True)
class StateTensorLayout:
    """One recurrent state tensor: name, dtype, sections (size, units) along the split axis,
    and the shape of one row."""

    name: str
    dtype: str
    sections: tuple[tuple[int, int], ...]
    row_shape: tuple[int, ...]

    def held(self, section: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """(first row, rows) of section `section` on rank `tp_rank` of `tp_size`."""
        size, units = self.sections[section]
        return held_rows(size, units, tp_size, tp_rank)

    def local_rows(self, tp_size: int) -> int:
        return sum(self.held(i, tp_size, 0)[1] for i in range(len(self.sections)))

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StateTensorLayout:
        return cls(
            name=data["name"],
            dtype=data["dtype"],
            sections=tuple((int(size), int(units)) for size, units in data["sections"]),
            row_shape=tuple(data["row_shape"]),
        )


@dataclass(frozen=True)
class PeerLayout:
    model_id: str  # a digest of the model's config (same weights assumed)
    tp_size: int
    tp_rank: int
    layer_kinds: tuple[str, ...]  # every sublayer's kind (workers/models/config.py LayerKind)
    # Attention (kv_heads_per_layer holds 0 for non-attention layers, the HF convention).
    kv_heads_per_layer: tuple[int, ...]
    num_kv_heads: int  # the model's, across ranks
    block_size: int
    head_dim: int
    kv_dtype: str
    # Recurrent state: the layer kind, how many layers hold it, and its tensors (pool order).
    state_kind: str
    num_state_layers: int
    state_tensors: tuple[StateTensorLayout, ...]
    kv_planes: int = 2

    @property
    def kv_heads_per_rank(self) -> int:
        """The first non-zero per-layer count (layer 0 of a hybrid is often recurrent)."""
        return next((h for h in self.kv_heads_per_layer if h), 0)

    @property
    def num_attention_layers(self) -> int:
        return sum(1 for h in self.kv_heads_per_layer if h)

    def full_geometry(self) -> dict[str, Any]:
        """The rank-independent shape: what two peers of any TP sizes must agree on."""
        return {
            "model_id": self.model_id,
            "layer_kinds": list(self.layer_kinds),
            "kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_dim": self.head_dim,
            "kv_dtype": self.kv_dtype,
            "kv_planes": self.kv_planes,
            "state_kind": self.state_kind,
            "state_layers": self.num_state_layers,
            "state_tensors": [
                [t.name, t.dtype, [list(s) for s in t.sections], list(t.row_shape)]
                for t in self.state_tensors
            ],
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
        for key in ("layer_kinds", "kv_heads_per_layer"):
            fields[key] = tuple(fields[key])
        fields["state_tensors"] = tuple(
            StateTensorLayout.from_wire(t) for t in fields["state_tensors"]
        )
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
