"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridserve.workers.speculative.stats import SpeculationStats

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: the log-probability of the token there, and the `top` most likely
    tokens of that position's distribution as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list[Any]:
        return [self.token_id, self.logprob, [list(pair) for pair in self.top]]

    @classmethod
    def from_wire(cls, data: list[Any]) -> TokenLogprobs:
        token_id, logprob, top = data
        return cls(int(token_id), float(logprob), tuple((int(t), float(p)) for t, p in top))


@dataclass(frozen=True, slots=True)
class Sample:
    """What the sampler drew from one logits row: one token per seed (a fork draws several),
    with their logprobs when the row asked for them. After a verify step (speculative
    decoding), the draft tokens that stood come first, in `accepted`: the request's new
    tokens are `accepted` and then `token_ids[0]`."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    accepted: tuple[int, ...] = ()
    accepted_logprobs: tuple[TokenLogprobs, ...] | None = None
    num_draft_tokens: int = 0  # drafts this step verified (len(accepted) of them stood)


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's shape of one token's log-probability: its rank among the position's tokens
    (None where it is not among the top ones returned); `decoded_token` is not filled."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One choice of a request, as vLLM's `RequestOutput.outputs[i]`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: token id -> Logprob, for the token drawn and the top ones.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    finish_reason: FinishReason | None
    num_cached_tokens: int  # prompt tokens reused from cache instead of computed
    text: str = ""  # the generated text; decoded once the request finishes
    error: str | None = None  # what went wrong, when finish_reason is "error"
    # With SamplingParams.logprobs: one entry per generated token (aligned with token_ids).
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token; the first is None (nothing
    # predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # n > 1: which choice this is; every choice's output names the request it forked from.
    index: int = 0
    parent_request_id: str | None = None
    # Offline LLM.generate with n > 1: every choice of the prompt, choice 0 first.
    choices: list[RequestOutput] = field(default_factory=list)
    # Speculative decoding: this request's drafts proposed and accepted (None: it verified
    # none).
    speculation: SpeculationStats | None = None
    # What stopped it, as vLLM reports it: the stop string (LLM), else the stop token id.
    stop_reason: str | int | None = None
    # How long it waited in this engine before its prompt was first scheduled.
    queued_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every choice, as vLLM's `outputs` (logprobs in its shape, without decoded_token:
        the tokenizer decodes them)."""
        return [choice._completion() for choice in self.choices or [self]]

    def _completion(self) -> CompletionOutput:
        logprobs = None
        if self.logprobs is not None:
            logprobs = []
            for entry in self.logprobs:
                ranked = {token: rank for rank, (token, _) in enumerate(entry.top, start=1)}
                one = {entry.token_id: Logprob(entry.logprob, ranked.get(entry.token_id))}
                for token, logprob in entry.top:
                    one.setdefault(token, Logprob(logprob, ranked[token]))
                logprobs.append(one)
        return CompletionOutput(
            self.index,
            self.text,
            self.token_ids,
            self.cumulative_logprob,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
