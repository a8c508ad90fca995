"""Per-request sampling parameters (vLLM names and meanings)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, description="None = no top-k filter")
    seed: int | None = Field(
        None,
        description="same seed + same prompt = same tokens; default: derived from the "
        "engine seed and the request id",
    )
    stop_token_ids: tuple[int, ...] = Field((), description="stop after any of these")
    ignore_eos: bool = Field(False, description="keep going past the model's EOS tokens")
    min_tokens: int = Field(0, ge=0, description="stop tokens are suppressed until this many")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
