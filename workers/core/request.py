"""One request's state: token ids plus cursors. There are no prefill/decode phases.

    token_ids: | prompt ........................ | output ...... |
                0                  num_computed_tokens         num_tokens
                [computed: KV + recurrent state exist)[to compute)

Each step the scheduler gives a request some of [num_computed_tokens, num_tokens); when a step
brings num_computed_tokens to num_tokens, the model's last logits sample one more token.
Prefill, chunked prefill, decode and recompute after preemption are all this one rule.

Speculative decoding adds guesses past the end for one step (`draft_token_ids`): the chunk
computes them too, and the tokens that stand are appended. When one is rejected the cursor
goes back to where the step started (the state with it, from a checkpoint), so the accepted
tokens are simply known tokens not computed yet, and the same rule computes them again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridserve.workers.core.outputs import FinishReason, RequestOutput, TokenLogprobs
from hybridserve.workers.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridserve.workers.cache.coordinator import InFlightReuse
    from hybridserve.workers.core.step_plan import SamplingRow
    from hybridserve.workers.core.structured_output import Grammar
    from hybridserve.workers.speculative.proposer import RequestSpeculation

# Choice i > 0 of request "r" is request "r#i" inside the engine.
CHOICE_SEPARATOR = "#"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Disaggregation: a prefill engine's request after its first token, holding its blocks and
    # slot for the transfer; a decode engine's request whose state is still arriving.
    HANDED_OFF = "handed_off"
    RECEIVING = "receiving"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Token ids that end the request (EOS unless ignore_eos, plus stop_token_ids).
    stop_token_ids: frozenset[int]
    # Sampling randomness seed; see `Sampler` for how it combines with the position.
    sample_seed: int
    # Reuse scope: requests with different salts (tenants) never share cached blocks.
    cache_salt: str | None = None
    # For chat requests: tokens of the conversation rendered without the generation prompt,
    # when those are a true prefix of the prompt (where the next turn will diverge).
    stable_prompt_len: int | None = None
    system_prompt_len: int | None = None  # where its system prompt ends (ChatPrompt.system_len)
    # Set by the cache manager before every scheduling pass: chunks must end at these
    # absolute positions. None = not set (an error under FORCE_CHUNK), [] = none wanted.
    expect_snapshot_points: list[int] | None = None
    # While waiting: the prompt in flight it waits for, and where (Scheduler._waits_for_prefix).
    prefix_wait: InFlightReuse | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why, when finish_reason is "error"
    # n > 1: choice `index` of the request `parent_id` forked from (None: the request itself,
    # which is choice 0). `choice_seeds` are the sampling seeds of choices 1..n-1, whose first
    # tokens are drawn with this request's first; `fork_token_ids` are those first tokens
    # while drawn but not yet forked (a prefill engine hands them to the decode engine, which
    # forks there).
    index: int = 0
    parent_id: str | None = None
    choice_seeds: tuple[int, ...] = ()
    fork_token_ids: tuple[int, ...] = ()
    fork_logprobs: tuple[TokenLogprobs | None, ...] = ()
    # Structured output: where the output stands in its grammar (None: unconstrained).
    grammar: Grammar | None = None
    # With logprobs: one per output token. With prompt_logprobs: one per prompt token scored
    # so far (the first prompt token has none), so prefix reuse is off for such requests.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Speculative decoding: the drafts this step verifies after the known tokens (empty
    # between steps), and the request's proposer state and acceptance counts.
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: RequestSpeculation | None = None
    # The row that samples its tokens once nothing about it changes from step to step (no
    # grammar, penalties or min_tokens ban, no choices to fork): built once (scheduler).
    sampling_row: SamplingRow | None = None
    # When it reached this engine, and how long it waited there before its prompt was first
    # scheduled (None until then): vLLM's queue time.
    arrival_time: float = field(default_factory=time.monotonic)
    queued_s: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def new_choice(self, index: int) -> Request:
        """Choice `index` of this n > 1 request, before its first token: same prompt, same
        parameters, its own seed, and a copy of the grammar state (taken before this request
        accepts its own first token)."""
        choice = Request(
            request_id=f"{self.request_id}{CHOICE_SEPARATOR}{index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            stop_token_ids=self.stop_token_ids,
            sample_seed=self.choice_seeds[index - 1],
            cache_salt=self.cache_salt,
            stable_prompt_len=self.stable_prompt_len,
            system_prompt_len=self.system_prompt_len,
            index=index,
            parent_id=self.request_id,
        )
        choice.num_cached_tokens = self.num_cached_tokens
        choice.expect_snapshot_points = self.expect_snapshot_points
        choice.prompt_logprobs = list(self.prompt_logprobs)
        choice.grammar = None if self.grammar is None else self.grammar.fork()
        return choice

    def record_prompt_logprobs(self, start: int, scored: list[TokenLogprobs]) -> None:
        """Logprobs a chunk starting at `start` scored (row i: token start + i + 1); keeps
        only the prompt tokens not scored yet (a recompute scores some again)."""
        for offset, logprobs in enumerate(scored):
            position = start + 1 + offset
            if position < self.num_prompt_tokens and position == len(self.prompt_logprobs) + 1:
                self.prompt_logprobs.append(logprobs)

    @property
    def scores_prompt(self) -> bool:
        """Prompt scoring needs the logits of every prompt token: nothing is reused."""
        return self.sampling_params.prompt_logprobs is not None

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            logprobs=None if self.sampling_params.logprobs is None else list(self.logprobs),
            prompt_logprobs=(
                None
                if self.sampling_params.prompt_logprobs is None
                else [None, *self.prompt_logprobs]
            ),
            index=self.index,
            parent_request_id=self.parent_id,
            speculation=None if self.speculation is None else self.speculation.stats.copy(),
            queued_s=self.queued_s,
        )
