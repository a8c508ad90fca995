"""A rank's block tables follow the plans' changes: whole tables, suffixes, entries replaced
in the middle, releases; a change this rank cannot place is refused."""

from __future__ import annotations

import pytest

from hybridserve.workers.core.step_plan import ScheduledChunk, StepPlan
from hybridserve.workers.runner.block_tables import BlockTables


def chunk(request_id: str, block_ids: list[int], table_from: int) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 5, block_ids, 0, table_from=table_from)


def test_a_rank_rebuilds_each_table_from_the_changes_its_chunks_carry():
    tables = BlockTables()
    first = StepPlan([chunk("a", [4, 5], 0), chunk("b", [9], 0)])
    tables.apply(first)
    grown = StepPlan([chunk("a", [6], 2), chunk("b", [], 1)])
    tables.apply(grown)
    assert grown.chunks[0].block_ids == [4, 5, 6] and grown.chunks[0].table_from == 0
    assert grown.chunks[1].block_ids == [9]
    # Entry 1 replaced by a block another request published (share_existing), one added.
    tables.apply(StepPlan([chunk("a", [7, 6, 8], 1)]))
    tables.apply(StepPlan(released=["b"]))
    assert tables.as_mapping() == {"a": [4, 7, 6, 8]}


def test_a_change_past_what_the_rank_holds_is_refused():
    tables = BlockTables()
    with pytest.raises(
        ValueError, match="request a's table changes from entry 2, but this rank holds no table"
    ):
        tables.apply(StepPlan([chunk("a", [3], 2)]))
    tables.apply(StepPlan([chunk("a", [3], 0)]))
    with pytest.raises(ValueError, match="holds 1 entries"):
        tables.apply(StepPlan([chunk("a", [3], 2)]))
