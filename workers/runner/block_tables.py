"""BlockTables: every running request's block table, as one rank keeps it.

The cache coordinator owns the tables; a step plan carries only what changed in each since the
request's last chunk (`ScheduledChunk.table_from` and the entries from there on) and the
requests whose tables went (`StepPlan.released`). Every rank applies each plan in order, so
every rank's copy equals the coordinator's at each chunk, and a decode step sends no table at
all, however long the context (a full table each step cost O(context) per request in the
scheduler, on the wire and here).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridserve.workers.core.step_plan import StepPlan


class BlockTables:
    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        """Bring the tables up to date with `plan`, and give each of its chunks the whole
        table (`block_ids` from entry 0)."""
        tables = self._tables
        for request_id in plan.released:
            tables.pop(request_id, None)
        for chunk in plan.chunks:
            if chunk.table_from == 0:
                tables[chunk.request_id] = chunk.block_ids
                continue
            table = tables.get(chunk.request_id)
            if table is None or chunk.table_from > len(table):
                raise ValueError(
                    f"step plan: request {chunk.request_id}'s table changes from entry "
                    f"{chunk.table_from}, but this rank holds "
                    f"{'no table' if table is None else f'{len(table)} entries'} for it"
                )
            if chunk.block_ids:
                del table[chunk.table_from :]
                table.extend(chunk.block_ids)
            chunk.block_ids, chunk.table_from = table, 0

    def as_mapping(self) -> Mapping[str, list[int]]:
        """Request id -> table, for the engine's integrity check."""
        return self._tables
