"""Heterogeneous tensor parallelism: state sharded for a prefill TP size moves, fragment by
fragment, into the shards of a decode TP size, and the decode shards put back together are the
full state exactly. The oracle shards and reassembles by hand (explicit head / row ranges), not
through the module under test.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.transceiver.tp_mapping import (
    Fragment,
    RegionShape,
    Section,
    apply,
    plan,
    region_pieces,
    section_offsets,
    shard,
)

TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)]

# (name, full shape, split axis, sections along that axis). Section sizes differ from each
# other so that a section offset taken from the wrong section shows up.
STATES = [
    # One KV block: (attention layers, K|V, kv heads, block_size, head_dim), split by kv heads.
    ("kv_block", (3, 2, 8, 16, 4), 2, (8,)),
    # A whole KV pool: (num_blocks, layers, K|V, heads, block_size, head_dim).
    ("kv_pool", (5, 2, 2, 4, 16, 2), 3, (4,)),
    # SSM state: (mamba layers, heads, head_dim, state_size), split by heads.
    ("ssm", (2, 8, 4, 16), 1, (8,)),
    # Conv state: (mamba layers, rows, width); rows are x | B | C, each split on its own.
    ("conv", (2, 48 + 16 + 8, 3), 1, (48, 16, 8)),
]


def full_state(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # Distinct values everywhere (a permutation), so any misplaced element is caught.
    numel = torch.Size(shape).numel()
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(numel, generator=generator).float().reshape(shape)


def shard_by_hand(
    full: torch.Tensor, axis: int, sections: tuple[int, ...], tp: int, rank: int
) -> torch.Tensor:
    """Rank `rank` holds rows [rank * size/tp, (rank+1) * size/tp) of every section."""
    index, start = [], 0
    for size in sections:
        local = size // tp
        index.extend(range(start + rank * local, start + (rank + 1) * local))
        start += size
    return full.index_select(axis, torch.tensor(index))


def unshard_by_hand(
    shards: list[torch.Tensor], axis: int, sections: tuple[int, ...]
) -> torch.Tensor:
    """Inverse of `shard_by_hand`: section by section, rank 0's rows, then rank 1's, ..."""
    tp = len(shards)
    pieces, start = [], 0
    for size in sections:
        local = size // tp
        pieces.extend(s.narrow(axis, start, local) for s in shards)
        start += local
    return torch.cat(pieces, dim=axis)


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
@pytest.mark.parametrize(("name", "shape", "axis", "sections"), STATES, ids=[s[0] for s in STATES])
def test_resharding_reassembles_the_full_state_exactly(name, shape, axis, sections, src_tp, dst_tp):
    full = full_state(shape, seed=src_tp * 10 + dst_tp)
    assert shape[axis] == sum(sections)
    sources = [shard_by_hand(full, axis, sections, src_tp, r) for r in range(src_tp)]
    # The module's own sharding agrees with the hand-made one.
    for rank in range(src_tp):
        assert torch.equal(shard(full, axis, sections, src_tp, rank), sources[rank])
    # Destinations start as NaN: an element no fragment writes stays NaN and fails torch.equal.
    dst_shape = list(shape)
    dst_shape[axis] = sum(sections) // dst_tp
    destinations = [torch.full(dst_shape, float("nan")) for _ in range(dst_tp)]

    fragments = plan(sections, src_tp, dst_tp)
    apply(fragments, sources, destinations, axis, sections, src_tp, dst_tp)

    for rank in range(dst_tp):
        assert torch.equal(destinations[rank], shard_by_hand(full, axis, sections, dst_tp, rank))
    assert torch.equal(unshard_by_hand(destinations, axis, sections), full)
    # The sources were only read.
    assert torch.equal(unshard_by_hand(sources, axis, sections), full)


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_every_destination_row_is_written_exactly_once(src_tp, dst_tp):
    sections = (48, 16, 8)
    written = [[0] * (sum(sections) // dst_tp) for _ in range(dst_tp)]
    offsets = section_offsets(sections, dst_tp)
    for f in plan(sections, src_tp, dst_tp):
        assert 0 <= f.src_rank < src_tp and 0 <= f.dst_rank < dst_tp
        assert f.src_start + f.length <= sections[f.section] // src_tp
        assert f.dst_start + f.length <= sections[f.section] // dst_tp
        for row in range(f.length):
            written[f.dst_rank][offsets[f.section] + f.dst_start + row] += 1
    assert written == [[1] * len(w) for w in written]


def test_two_to_four_splits_each_source_shard_in_two():
    """SSM heads 8, prefill TP 2 (4 heads per rank) -> decode TP 4 (2 per rank)."""
    assert plan((8,), 2, 4) == [
        Fragment(src_rank=0, dst_rank=0, section=0, src_start=0, dst_start=0, length=2),
        Fragment(src_rank=0, dst_rank=1, section=0, src_start=2, dst_start=0, length=2),
        Fragment(src_rank=1, dst_rank=2, section=0, src_start=0, dst_start=0, length=2),
        Fragment(src_rank=1, dst_rank=3, section=0, src_start=2, dst_start=0, length=2),
    ]


def test_four_to_two_gathers_pairs_of_source_shards_per_section():
    """Conv rows x | B | C = 8 | 4 | 4, prefill TP 4 -> decode TP 2: per section, decode rank
    j takes source ranks 2j and 2j+1 laid end to end."""
    assert plan((8, 4, 4), 4, 2) == [
        Fragment(0, 0, 0, 0, 0, 2),
        Fragment(1, 0, 0, 0, 2, 2),
        Fragment(2, 1, 0, 0, 0, 2),
        Fragment(3, 1, 0, 0, 2, 2),
        Fragment(0, 0, 1, 0, 0, 1),
        Fragment(1, 0, 1, 0, 1, 1),
        Fragment(2, 1, 1, 0, 0, 1),
        Fragment(3, 1, 1, 0, 1, 1),
        Fragment(0, 0, 2, 0, 0, 1),
        Fragment(1, 0, 2, 0, 1, 1),
        Fragment(2, 1, 2, 0, 0, 1),
        Fragment(3, 1, 2, 0, 1, 1),
    ]
    assert section_offsets((8, 4, 4), 2) == [0, 4, 6]
    assert section_offsets((8, 4, 4), 4) == [0, 2, 3]


def test_equal_tp_sizes_copy_whole_sections_rank_to_rank():
    assert plan((6, 2), 2, 2) == [
        Fragment(0, 0, 0, 0, 0, 3),
        Fragment(1, 1, 0, 0, 0, 3),
        Fragment(0, 0, 1, 0, 0, 1),
        Fragment(1, 1, 1, 0, 0, 1),
    ]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 3), (3, 2), (4, 6), (6, 4)])
def test_tp_sizes_that_do_not_divide_each_other_are_refused(src_tp, dst_tp):
    with pytest.raises(
        ValueError, match=f"tensor-parallel sizes {src_tp} and {dst_tp}: one must divide the other"
    ):
        plan((12,), src_tp, dst_tp)


@pytest.mark.parametrize(
    ("sections", "src_tp", "dst_tp", "bad"),
    [
        ((6,), 4, 2, 6),  # 8 -> 6 KV heads is not 4-way splittable
        ((64, 6, 6), 1, 4, 6),  # conv sections (n_groups * d_state) must divide by TP
        ((64, 32, 30), 2, 4, 30),
        ((8, 6), 8, 1, 6),  # 6 units over 8 ranks: neither split nor replicated
    ],
)
def test_sections_that_cannot_be_split_evenly_are_refused(sections, src_tp, dst_tp, bad):
    with pytest.raises(
        ValueError, match=f"a section of {bad} cannot be split across {src_tp} and {dst_tp} ranks"
    ):
        plan(sections, src_tp, dst_tp)


# ---- replicated units ----------------------------------------------------------------------

# KV heads 2 (rows = heads here) and B/C groups 2 of 3 rows each: replicated over 4 ranks.
REPLICATED = (Section(2, units=2),)
GROUPED = (Section(8), Section(6, units=2), Section(6, units=2))  # conv x | B | C


def replicated_by_hand(full, axis, sections, tp, rank):
    """1/tp of a section with at least tp units; otherwise the whole unit rank // (tp / units)
    reads (replicated)."""
    index, start = [], 0
    for section in sections:
        units = section.units or section.size
        if units >= tp:
            rows = section.size // tp
            first = rank * rows
        else:
            rows = section.size // units
            first = rank // (tp // units) * rows
        index.extend(range(start + first, start + first + rows))
        start += section.size
    return full.index_select(axis, torch.tensor(index))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 4), (4, 1), (2, 4), (4, 2), (4, 4), (1, 2)])
@pytest.mark.parametrize("sections", [REPLICATED, GROUPED], ids=["kv-heads", "conv-groups"])
def test_replicated_units_reach_every_rank_that_reads_them(sections, src_tp, dst_tp):
    full = full_state((3, sum(s.size for s in sections), 5), seed=src_tp + 7 * dst_tp)
    sources = [replicated_by_hand(full, 1, sections, src_tp, r) for r in range(src_tp)]
    for rank in range(src_tp):
        assert torch.equal(shard(full, 1, sections, src_tp, rank), sources[rank])
    destinations = [
        torch.full_like(replicated_by_hand(full, 1, sections, dst_tp, r), float("nan"))
        for r in range(dst_tp)
    ]
    fragments = plan(sections, src_tp, dst_tp)
    apply(fragments, sources, destinations, 1, sections, src_tp, dst_tp)
    for rank in range(dst_tp):
        assert torch.equal(destinations[rank], replicated_by_hand(full, 1, sections, dst_tp, rank))
    # Each destination row is written once.
    assert len({(f.dst_rank, f.section, f.dst_start) for f in fragments}) == len(fragments)


def test_reads_of_replicated_rows_spread_over_the_replicas():
    """2 KV heads at TP 4 -> TP 4: each decode rank reads its head from the source rank that
    is its own replica, not all from the first."""
    fragments = plan(REPLICATED, 4, 4)
    assert [(f.src_rank, f.dst_rank) for f in fragments] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_region_pieces_are_byte_ranges_of_the_strided_head_runs():
    """A KV block (2 layers x K|V, heads, 16-byte rows): TP 1 (4 heads) -> TP 2 rank 1 reads
    heads 2-3 of each of the 4 runs; equal layouts collapse into one whole-region piece."""
    fragments = [f for f in plan((4,), 1, 2) if f.dst_rank == 1]
    src, dst = RegionShape(4, 4, 16), RegionShape(4, 2, 16)
    assert region_pieces(fragments, (4,), src, dst, 1, 2) == [
        (32, 0, 32),
        (96, 32, 32),
        (160, 64, 32),
        (224, 96, 32),
    ]
    same = RegionShape(4, 2, 16)
    identity = [f for f in plan((4,), 2, 2) if f.dst_rank == 0]
    assert region_pieces(identity, (4,), same, same, 2, 2) == [(0, 0, same.nbytes)]
