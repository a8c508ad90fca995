"""Speculative decoding's engine argument, shaped as vLLM's `speculative_config`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# More drafts than this cost more to verify than a step gains: a verify chunk is as many rows
# as drafts plus one, and a CPU step of up to eight rows streams the weights once.
MAX_SPECULATIVE_TOKENS = 16

SpeculativeMethod = Literal["ngram", "draft_model", "mtp"]


class SpeculativeConfig(BaseModel):
    """How a decode step guesses and verifies several tokens of each request at once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: SpeculativeMethod = Field(
        "ngram",
        description="ngram: prompt lookup over the request's own tokens (prompt and output); "
        "draft_model: a smaller checkpoint with the target's vocabulary; mtp: the "
        "checkpoint's multi-token-prediction layers",
    )
    num_speculative_tokens: int = Field(
        4,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="draft tokens verified per request per step (fewer when the proposer "
        "has fewer, or the request's remaining tokens or the step's budget are fewer)",
    )
    model: str | None = Field(
        None,
        description="draft_model: the draft checkpoint ('tiny' or an HF-format folder; the "
        "target's vocabulary, at least max_model_len positions)",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, description="ngram: the shortest suffix of the sequence that is looked up"
    )
    prompt_lookup_max: int = Field(
        4, ge=1, description="ngram: the longest suffix looked up (the longest match wins)"
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="no drafts while more requests than this run (vLLM's "
        "disable_by_batch_size); default: on the CPU, the largest batch whose verify rows "
        "(requests x (num_speculative_tokens + 1)) fit the native step's eight, at least 1 "
        "(past that a small CPU is compute-bound: docs/speculative-decoding.md); on GPUs, "
        "no limit",
    )
    disable_below_acceptance: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="a request whose drafts are accepted less often than this (over its last "
        "verify steps) stops proposing for a while, doubling the pause each time, so that a "
        "continuation nothing predicts costs what plain decoding costs",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is larger "
                f"than prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError(
                "speculative_config: method 'draft_model' needs model, the draft checkpoint "
                "('tiny' or an HF-format folder)"
            )
        if self.model is not None and self.method != "draft_model":
            raise ValueError(
                f"speculative_config: model is the draft_model method's checkpoint, but "
                f"method is {self.method!r}"
            )
        return self
