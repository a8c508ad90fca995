"""Moving state between tensor-parallel layouts: prefill TP p, decode TP d, one divides the other.

Every kind of state is split across ranks along one axis, in contiguous sections:

    KV block:  kv heads                    (attn_layers, 2, heads, block_size, head_dim): axis 2
    SSM state: heads                       (mamba_layers, heads, head_dim, state):        axis 1
    conv:      rows, per section x | B | C (mamba_layers, rows, width):                   axis 1

A `Fragment` says: rows [src_start, src_start + length) of section s on source rank i go to
rows [dst_start, ...) of the same section on destination rank j. With r = larger / smaller TP,
the coarser side's shard is r of the finer side's shards laid end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fragment:
    src_rank: int
    dst_rank: int
    section: int
    src_start: int  # offset inside the source rank's shard of this section
    dst_start: int  # offset inside the destination rank's shard of this section
    length: int


def plan(sections: tuple[int, ...], src_tp: int, dst_tp: int) -> list[Fragment]:
    """Fragments that turn `src_tp` shards into `dst_tp` shards of state split in `sections`
    (full sizes along the split axis, each divided evenly across ranks)."""
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise ValueError(f"tensor-parallel sizes {src_tp} and {dst_tp}: one must divide the other")
    for size in sections:
        if size % src_tp or size % dst_tp:
            raise ValueError(
                f"a section of {size} cannot be split across {src_tp} and {dst_tp} ranks"
            )
    fragments = []
    for index, size in enumerate(sections):
        src_len, dst_len = size // src_tp, size // dst_tp
        piece = min(src_len, dst_len)
        # Walk the section in pieces of the finer shard size: piece k lives on source rank
        # k * piece // src_len and destination rank k * piece // dst_len.
        for k in range(size // piece):
            start = k * piece
            fragments.append(
                Fragment(
                    src_rank=start // src_len,
                    dst_rank=start // dst_len,
                    section=index,
                    src_start=start % src_len,
                    dst_start=start % dst_len,
                    length=piece,
                )
            )
    return fragments


def shard(
    full: torch.Tensor, axis: int, sections: tuple[int, ...], tp: int, rank: int
) -> torch.Tensor:
    """This rank's part of `full`: 1/tp of every section along `axis`, sections concatenated."""
    pieces, offset = [], 0
    for size in sections:
        local = size // tp
        pieces.append(full.narrow(axis, offset + rank * local, local))
        offset += size
    return torch.cat(pieces, dim=axis)


def section_offsets(sections: tuple[int, ...], tp: int) -> list[int]:
    """Where each section starts inside one rank's shard."""
    offsets, offset = [], 0
    for size in sections:
        offsets.append(offset)
        offset += size // tp
    return offsets


def apply(
    fragments: list[Fragment],
    sources: list[torch.Tensor],
    destinations: list[torch.Tensor],
    axis: int,
    sections: tuple[int, ...],
    src_tp: int,
    dst_tp: int,
) -> None:
    """Copy every fragment from the source shards into the destination shards."""
    src_offsets, dst_offsets = section_offsets(sections, src_tp), section_offsets(sections, dst_tp)
    for f in fragments:
        src = sources[f.src_rank].narrow(axis, src_offsets[f.section] + f.src_start, f.length)
        dst = destinations[f.dst_rank].narrow(axis, dst_offsets[f.section] + f.dst_start, f.length)
        dst.copy_(src)
