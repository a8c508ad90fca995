"""The eager path: any step, the model's layers called one after the other."""

from __future__ import annotations

import torch

from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.runner.forward_batch import ForwardBatch
from hybridserve.workers.runner.paths.base import BatchPath


class EagerPath(BatchPath):
    name = "eager"

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return True

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.runner.model(batch, self.runner.caches)
