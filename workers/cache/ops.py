"""The data moves cache managers ask for, and the interface of whoever performs them.

Managers decide, the model runner moves bytes. A manager calls its executor at the moment of
the decision (say, right before an evicted block is handed to another request), so every copy
is ordered before anything that could overwrite its source: no pins, no deferred queues.
"""

from __future__ import annotations

from typing import Protocol


class CacheOpExecutor(Protocol):
    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` token rows of KV block `src` into block `dst`."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy Mamba state slot `src` (conv + SSM, every layer) into slot `dst`."""

    def offload_block(self, block_id: int, host_id: int) -> None:
        """Device KV block -> host tier block."""

    def load_block(self, host_id: int, block_id: int) -> None:
        """Host tier block -> device KV block."""

    def offload_slot(self, slot: int, host_slot: int) -> None:
        """Device Mamba slot -> host tier slot."""

    def load_slot(self, host_slot: int, slot: int) -> None:
        """Host tier slot -> device Mamba slot."""
