"""Proposers, and the `Speculator` the scheduler asks for each request's drafts.

A proposer guesses up to `num_tokens` tokens that follow a request's known tokens. The
speculator puts the policy around it: how many drafts a request may verify this step, drafts
the request's grammar would refuse cut off (structured output), and a pause for a request
whose drafts keep being rejected (each verify step costs a checkpoint copy and wider rows, so
a continuation nothing predicts should cost what plain decoding costs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from hybridserve.workers.core.request import Request
from hybridserve.workers.speculative.config import SpeculativeConfig
from hybridserve.workers.speculative.ngram import NgramIndex
from hybridserve.workers.speculative.stats import SpeculationStats

# The acceptance test looks at a request's last verify steps, at least this many draft
# tokens; a pause starts at FIRST_PAUSE decode steps and doubles, up to MAX_PAUSE.
WINDOW_DRAFT_TOKENS = 16
FIRST_PAUSE, MAX_PAUSE = 8, 256


class Proposer(ABC):
    @abstractmethod
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses of the tokens after `request.token_ids`."""


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        state = request.speculation
        assert state is not None
        if state.ngrams is None:
            state.ngrams = NgramIndex(self.min_n, self.max_n)
        return state.ngrams.propose(request.token_ids, num_tokens)


@dataclass(slots=True)
class RequestSpeculation:
    """One request's speculation: its proposer's state, its counts, its pause."""

    stats: SpeculationStats = field(default_factory=SpeculationStats)
    ngrams: NgramIndex | None = None
    window_drafts: int = 0  # draft tokens and accepted ones since the last check
    window_accepted: int = 0
    paused_steps: int = 0  # decode steps left without proposing
    next_pause: int = FIRST_PAUSE


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_batch_size: int | None) -> None:
        """`max_batch_size`: no drafts while more requests run (None: no limit)."""
        self.config = config
        self.max_batch_size = max_batch_size
        self.proposer = NgramProposer(config)
        self.stats = SpeculationStats()  # the engine's, since start
        self.num_paused = 0  # pauses started, since start

    def drafts(self, request: Request, limit: int, batch_size: int) -> list[int]:
        """The drafts `request` verifies this step: at most `limit` (what its budget, output
        and length allow) and num_speculative_tokens; none while more than max_batch_size
        requests run (`batch_size`)."""
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            return []
        state = request.speculation
        if state is None:
            state = request.speculation = RequestSpeculation()
        if state.paused_steps:
            state.paused_steps -= 1
            return []
        count = min(limit, self.config.num_speculative_tokens)
        if count <= 0:
            return []
        drafts = self.proposer.propose(request, count)
        if drafts and request.grammar is not None:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def record(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A verify step's outcome; pauses the request when its acceptance is too low."""
        state = request.speculation
        assert state is not None
        state.stats.record(num_draft_tokens, num_accepted)
        self.stats.record(num_draft_tokens, num_accepted)
        state.window_drafts += num_draft_tokens
        state.window_accepted += num_accepted
        if state.window_drafts < WINDOW_DRAFT_TOKENS:
            return
        rate = state.window_accepted / state.window_drafts
        state.window_drafts = state.window_accepted = 0
        if rate < self.config.disable_below_acceptance:
            state.paused_steps = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE)
            self.num_paused += 1
        else:
            state.next_pause = FIRST_PAUSE
