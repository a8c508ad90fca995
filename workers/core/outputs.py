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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
