"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    finish_reason: FinishReason | None
    num_cached_tokens: int  # prompt tokens reused from cache instead of computed
    text: str = ""  # the generated text; decoded once the request finishes
    error: str | None = None  # what went wrong, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
