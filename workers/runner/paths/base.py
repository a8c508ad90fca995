"""The forward path interface, and the part that paths over a packed batch share.

A path is created when the runner is, with the runner; it says at once whether it can serve
the runner's model, device and tensor-parallel size (`unsupported`), and once the pools exist
it builds, compiles or captures what it needs (`prepare`). Each step, the runner asks the
paths in the engine's order whether they accept the step's chunks and runs the first that
does: `eager` accepts every step, so the list always ends there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from hybridserve.workers.runner.model_runner import ModelRunner, RunnerOutput


class ForwardPath(ABC):
    name: ClassVar[str]

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def unsupported(self) -> str | None:
        """Why this path cannot serve the runner's model, device and tensor-parallel size
        (None: it can). Side-effect free; asked once, before the pools exist."""
        return None

    def prepare(self) -> str | None:
        """Build what the path needs over the runner's pools, which exist now (may take
        seconds: a compilation, graph captures). Why it cannot serve after all (None: ready);
        a path that returns a reason is dropped, and nothing of it stays in the pools."""
        return None

    @abstractmethod
    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this path runs a step of these chunks. Side-effect free."""

    @abstractmethod
    def run(self, chunks: list[ScheduledChunk]) -> RunnerOutput | None:
        """Run an accepted step (its cache ops are applied): the forward pass, and on the
        driver the samples and prompt scores (None on the other ranks). Writes the chunks'
        KV and Mamba state into the pools."""


class BatchPath(ForwardPath):
    """A path that runs the model over a packed `ForwardBatch` and samples from its hidden
    states: decode rows first, sorted by slot so that their states form one contiguous run
    of the pool, then prompt chunks (forward_batch.py draws the layout)."""

    @property
    def batch_device(self) -> torch.device:
        """Where the batch's tensors are built."""
        return self.runner.device

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The final-normed hidden states of `batch` (as `model(batch, caches)`)."""

    def run(self, chunks: list[ScheduledChunk]) -> RunnerOutput | None:
        order = sorted(
            range(len(chunks)),
            key=lambda i: (not chunks[i].is_decode, chunks[i].slot if chunks[i].is_decode else 0),
        )
        items = [chunks[i] for i in order]
        batch, row_ranges = self.runner.build_batch(items, self.batch_device)
        return self.runner.sample_hidden(items, order, batch, self.forward(batch), row_ranges)
