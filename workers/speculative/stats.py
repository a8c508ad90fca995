"""Acceptance counts, per request and per engine (vLLM's spec_decode metrics as the model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpeculationStats:
    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    # Position j: how often the draft at offset j of a verify step was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend(
                [0] * (num_draft_tokens - len(self.accepted_per_position))
            )
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens (None before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify step yields on average: the accepted drafts plus the one the
        target always adds (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def copy(self) -> SpeculationStats:
        return SpeculationStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )

    def to_wire(self) -> list[Any]:
        return [
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        ]

    @classmethod
    def from_wire(cls, data: list[Any]) -> SpeculationStats:
        drafts, draft_tokens, accepted, per_position = data
        return cls(int(drafts), int(draft_tokens), int(accepted), [int(n) for n in per_position])
