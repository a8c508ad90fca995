"""Per-request sampling parameters (vLLM names and meanings).

Order of the logits processing, as vLLM applies it (docs/sampling.md):

    raw logits ─┬─> logprobs returned to the client (log-softmax of the raw logits)
                └─> + logit_bias ─> banned / grammar mask ─> repetition, frequency and
                    presence penalties ─> greedy argmax, or temperature ─> top-k ─> top-p
                    ─> min-p ─> a draw seeded by (seed, output position)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGIT_BIAS = 100.0


class StructuredOutput(BaseModel):
    """A constraint on the output's text, compiled to a token mask (structured_output.py).

    kind: "json" (any JSON object), "json_schema" (`spec` is a JSON Schema, as a JSON string),
    "regex" (`spec` is a regular expression), "choice" (`spec` is a JSON list of strings, the
    output is exactly one of them), "grammar" (`spec` is a Lark or an EBNF/GBNF grammar)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json", "json_schema", "regex", "choice", "grammar"]
    spec: str = ""


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(1, ge=1, le=128, description="choices, forked from one prefill")
    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, description="None = no top-k filter")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability"
    )
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtracted once from every token already generated"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the generated tokens"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="tokens of the prompt or the output: positive logits divided by it, "
        "negative ones multiplied",
    )
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (), description="(token id, bias) pairs added to the logits, bias in [-100, 100]"
    )
    seed: int | None = Field(
        None,
        description="same seed + same prompt = same tokens; default: derived from the "
        "engine seed and the request id; choice i of n draws with seed + i",
    )
    stop: tuple[str, ...] = Field(
        (),
        description="stop strings: the text ends before the first (LLM.generate and the OpenAI "
        "server match them; Engine.add_request refuses them, it stops on token ids)",
    )
    include_stop_str_in_output: bool = Field(
        False, description="keep the stop string that ended the text in it"
    )
    stop_token_ids: tuple[int, ...] = Field((), description="stop after any of these")
    ignore_eos: bool = Field(False, description="keep going past the model's EOS tokens")
    min_tokens: int = Field(0, ge=0, description="stop tokens are suppressed until this many")
    logprobs: int | None = Field(
        None, ge=0, description="per generated token: its log-probability and the top N"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, description="per prompt token: its log-probability and the top N"
    )
    structured_output: StructuredOutput | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        for token_id, bias in value:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias for token {token_id} is {bias}; biases must lie in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = (value,)  # vLLM takes one string too
        if isinstance(value, (list, tuple)) and "" in value:
            raise ValueError("stop strings must not be empty")
        return value

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

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def choice_seed(self, index: int) -> int | None:
        """The seed choice `index` of n draws with (vLLM's rule: seed + index)."""
        return None if self.seed is None else self.seed + index
