"""Moving state between tensor-parallel layouts: prefill TP p, decode TP d.

Every kind of state is split across ranks along one axis, in sections; within a section the
rows come in `units` (heads, groups) that are never cut:

    KV block:      kv heads        (attn_layers, planes, heads, block_size, head_dim): axis 2
    state tensor:  its sections    (state_layers, rows, *row_shape):                   axis 1
                   (Mamba2 conv: x | B | C, SSM: heads; Gated DeltaNet conv: q | k | v,
                   recurrent: value heads; the layout carries them, layout.py)

A rank holds 1/tp of a section's rows when it has at least tp units; with fewer units each rank
holds one whole unit, replicated over tp / units ranks (KV heads or B/C groups fewer than the
ranks; docs/tensor-parallel.md). A `Fragment` says: rows [src_start, src_start + length) of
section s on source rank i go to rows [dst_start, ...) of the same section on destination rank
j. Every destination row is written exactly once; a row several source ranks hold (replicated)
is read from one of them, chosen by the destination rank, so the reads spread over the sources.

`region_pieces` turns fragments into byte ranges of one block or slot region (contiguous per
rank, as the pools lay them out), which is what the transfer backends move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.transceiver.layout import PeerLayout, held_rows


@dataclass(frozen=True)
class Section:
    """`size` rows along the split axis, in `units` indivisible units (default: every row)."""

    size: int
    units: int = 0

    @property
    def num_units(self) -> int:
        return self.units or self.size


@dataclass(frozen=True)
class Fragment:
    src_rank: int
    dst_rank: int
    section: int
    src_start: int  # offset inside the source rank's shard of this section
    dst_start: int  # offset inside the destination rank's shard of this section
    length: int


def _sections(sections: Sequence[int | Section]) -> list[Section]:
    return [s if isinstance(s, Section) else Section(s) for s in sections]


def holding(section: Section, tp: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `section` that rank `rank` of `tp` holds."""
    return held_rows(section.size, section.num_units, tp, rank)


def _check(section: Section, tp: int, src_tp: int, dst_tp: int) -> None:
    units = section.num_units
    if section.size % units or (units % tp if units >= tp else tp % units):
        raise ValueError(
            f"a section of {section.size} cannot be split across {src_tp} and {dst_tp} ranks"
        )


def plan(sections: Sequence[int | Section], src_tp: int, dst_tp: int) -> list[Fragment]:
    """Fragments that turn `src_tp` shards into `dst_tp` shards of state in `sections` (full
    sizes along the split axis; a plain size is a section of single-row units)."""
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise ValueError(f"tensor-parallel sizes {src_tp} and {dst_tp}: one must divide the other")
    parsed = _sections(sections)
    for section in parsed:
        _check(section, src_tp, src_tp, dst_tp)
        _check(section, dst_tp, src_tp, dst_tp)
    fragments = []
    for index, section in enumerate(parsed):
        # Source ranks by the rows they hold: replicas hold the same range.
        holders: dict[tuple[int, int], list[int]] = {}
        for rank in range(src_tp):
            holders.setdefault(holding(section, src_tp, rank), []).append(rank)
        for dst_rank in range(dst_tp):
            dst_first, dst_rows = holding(section, dst_tp, dst_rank)
            for (src_first, src_rows), ranks in holders.items():
                first = max(dst_first, src_first)
                end = min(dst_first + dst_rows, src_first + src_rows)
                if first < end:
                    fragments.append(
                        Fragment(
                            src_rank=ranks[dst_rank % len(ranks)],
                            dst_rank=dst_rank,
                            section=index,
                            src_start=first - src_first,
                            dst_start=first - dst_first,
                            length=end - first,
                        )
                    )
    return fragments


def section_offsets(sections: Sequence[int | Section], tp: int) -> list[int]:
    """Where each section starts inside one rank's shard."""
    offsets, offset = [], 0
    for section in _sections(sections):
        offsets.append(offset)
        offset += holding(section, tp, 0)[1]
    return offsets


def shard(
    full: torch.Tensor, axis: int, sections: Sequence[int | Section], tp: int, rank: int
) -> torch.Tensor:
    """This rank's part of `full`: its rows of every section along `axis`, concatenated."""
    pieces, offset = [], 0
    for section in _sections(sections):
        first, rows = holding(section, tp, rank)
        pieces.append(full.narrow(axis, offset + first, rows))
        offset += section.size
    return torch.cat(pieces, dim=axis)


def apply(
    fragments: list[Fragment],
    sources: list[torch.Tensor],
    destinations: list[torch.Tensor],
    axis: int,
    sections: Sequence[int | Section],
    src_tp: int,
    dst_tp: int,
) -> None:
    """Copy every fragment from the source shards into the destination shards."""
    src_offsets, dst_offsets = section_offsets(sections, src_tp), section_offsets(sections, dst_tp)
    for f in fragments:
        src = sources[f.src_rank].narrow(axis, src_offsets[f.section] + f.src_start, f.length)
        dst = destinations[f.dst_rank].narrow(axis, dst_offsets[f.section] + f.dst_start, f.length)
        dst.copy_(src)


@dataclass(frozen=True)
class RegionShape:
    """One rank's block or slot region, as bytes: `outer` runs (layers, K|V) of `rows` rows
    along the split axis, `row_bytes` each."""

    outer: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.outer * self.rows * self.row_bytes


Piece = tuple[int, int, int]  # (source offset, destination offset, bytes) inside a region


def region_pieces(
    fragments: list[Fragment],
    sections: Sequence[int | Section],
    src: RegionShape,
    dst: RegionShape,
    src_tp: int,
    dst_tp: int,
) -> list[Piece]:
    """The byte ranges that carry `fragments` (already filtered to one rank pair) between a
    source region and a destination region; adjacent ranges are merged, so equal layouts
    give one piece: the whole region."""
    assert src.row_bytes == dst.row_bytes and src.outer == dst.outer
    src_offsets, dst_offsets = section_offsets(sections, src_tp), section_offsets(sections, dst_tp)
    pieces: list[Piece] = []
    for outer in range(src.outer):
        for f in sorted(fragments, key=lambda f: (f.section, f.dst_start)):
            src_row = outer * src.rows + src_offsets[f.section] + f.src_start
            dst_row = outer * dst.rows + dst_offsets[f.section] + f.dst_start
            piece = (src_row * src.row_bytes, dst_row * dst.row_bytes, f.length * src.row_bytes)
            if (
                pieces
                and pieces[-1][0] + pieces[-1][2] == piece[0]
                and (pieces[-1][1] + pieces[-1][2] == piece[1])
            ):
                last = pieces.pop()
                piece = (last[0], last[1], last[2] + piece[2])
            pieces.append(piece)
    return pieces


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def state_geometry(layout: PeerLayout) -> dict[str, tuple[tuple[Section, ...], RegionShape]]:
    """Per region kind of an engine ("kv", then each state tensor): its sections (the model's,
    in units) and this rank's region shape."""
    geometry: dict[str, tuple[tuple[Section, ...], RegionShape]] = {}
    if layout.num_attention_layers:
        row = layout.block_size * layout.head_dim * _itemsize(layout.kv_dtype)
        geometry["kv"] = (
            (Section(layout.num_kv_heads, units=layout.num_kv_heads),),
            RegionShape(
                layout.num_attention_layers * layout.kv_planes, layout.kv_heads_per_rank, row
            ),
        )
    for tensor in layout.state_tensors:
        geometry[tensor.name] = (
            tuple(Section(size, units=units) for size, units in tensor.sections),
            RegionShape(
                layout.num_state_layers,
                tensor.local_rows(layout.tp_size),
                math.prod(tensor.row_shape) * _itemsize(tensor.dtype),
            ),
        )
    return geometry


def pair_pieces(src: PeerLayout, dst: PeerLayout) -> dict[str, tuple[Piece, ...]]:
    """Per state kind, the byte ranges source rank `src.tp_rank` sends to destination rank
    `dst.tp_rank` (empty when that pair exchanges nothing of the kind)."""
    pieces: dict[str, tuple[Piece, ...]] = {}
    dst_geometry = state_geometry(dst)
    for kind, (sections, src_shape) in state_geometry(src).items():
        _, dst_shape = dst_geometry[kind]
        fragments = [
            f
            for f in plan(sections, src.tp_size, dst.tp_size)
            if f.src_rank == src.tp_rank and f.dst_rank == dst.tp_rank
        ]
        pieces[kind] = tuple(
            region_pieces(fragments, sections, src_shape, dst_shape, src.tp_size, dst.tp_size)
            if fragments
            else ()
        )
    return pieces
