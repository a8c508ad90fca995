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
    # Positions past a request's tokens whose KV the proposer writes in the step (MTP layers
    # guessing at its end): the scheduler allocates blocks that far ahead.
    lookahead: int = 0

    @abstractmethod
    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Per (request, count): up to `count` (at least 1) guesses of the tokens after
        `request.token_ids`, for one step."""

    def verified(self, request: Request, num_accepted: int) -> None:  # noqa: B027
        """How many of the request's last proposal stood (its other tokens were rejected)."""

    def release(self, request: Request) -> None:  # noqa: B027
        """The request ended or was preempted: drop what is kept for it."""

    def shutdown(self) -> None:  # noqa: B027
        """The engine stops."""


class NgramProposer(Proposer):
    """Prompt lookup (ngram.py); each request keeps its index in `request.speculation`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        drafts = []
        for request, count in batch:
            state = request.speculation
            assert state is not None
            if state.ngrams is None:
                state.ngrams = NgramIndex(self.min_n, self.max_n)
            drafts.append(state.ngrams.propose(request.token_ids, count))
        return drafts


@dataclass(slots=True)
class RequestSpeculation:
    """One request's speculation: its proposer's state, its counts, its pause."""

    stats: SpeculationStats = field(default_factory=SpeculationStats)
    ngrams: NgramIndex | None = None
    pending: list[int] = field(default_factory=list)  # MTP: guesses from the last step
    window_drafts: int = 0  # draft tokens and accepted ones since the last check
    window_accepted: int = 0
    paused_steps: int = 0  # decode steps left without proposing
    next_pause: int = FIRST_PAUSE


def speculation_of(request: Request) -> RequestSpeculation:
    """The request's speculation state, made on first use."""
    if request.speculation is None:
        request.speculation = RequestSpeculation()
    return request.speculation


def hold_drafts(request: Request, drafts: list[int]) -> None:
    """Guesses made for the request's next step (MTP: at the end of this one, or by the
    prefill engine that handed it over)."""
    speculation_of(request).pending = drafts


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_batch_size: int | None
    ) -> None:
        """`max_batch_size`: no drafts while more requests run (None: no limit)."""
        self.config = config
        self.proposer = proposer
        self.max_batch_size = max_batch_size
        self.stats = SpeculationStats()  # the engine's, since start
        self.num_paused = 0  # pauses started, since start
        # Rolled-back verify steps, and the tokens they computed that the next step computes
        # again (the price of checkpoint-and-replay), since start.
        self.num_rollbacks = 0
        self.num_replayed_tokens = 0

    def drafts(self, batch: list[tuple[Request, int]], batch_size: int) -> list[list[int]]:
        """Per (request, limit): the drafts it verifies this step, at most `limit` (what its
        budget, output and length allow) and num_speculative_tokens; none while more than
        max_batch_size requests run (`batch_size`) or while the request pauses."""
        drafts: list[list[int]] = [[] for _ in batch]
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            return drafts
        asked: list[int] = []
        for index, (request, limit) in enumerate(batch):
            state = speculation_of(request)
            if state.paused_steps:
                state.paused_steps -= 1
            elif min(limit, self.config.num_speculative_tokens) > 0:
                asked.append(index)
        if not asked:
            return drafts
        counts = [min(batch[i][1], self.config.num_speculative_tokens) for i in asked]
        proposed = self.proposer.propose(
            [(batch[i][0], count) for i, count in zip(asked, counts, strict=True)]
        )
        for index, guesses in zip(asked, proposed, strict=True):
            grammar = batch[index][0].grammar
            if guesses and grammar is not None:
                guesses = guesses[: grammar.valid_prefix(guesses)]
            drafts[index] = guesses
        return drafts

    def dropped(self, request: Request) -> None:
        """The request's drafts were proposed but will not be verified (no room)."""
        self.proposer.verified(request, 0)

    def release(self, request: Request) -> None:
        self.proposer.release(request)

    def record(
        self, request: Request, num_draft_tokens: int, num_accepted: int, replayed: int
    ) -> None:
        """A verify step's outcome (`replayed`: tokens to compute again after a rollback);
        pauses the request when its acceptance is too low."""
        state = request.speculation
        assert state is not None
        self.num_rollbacks += replayed > 0
        self.num_replayed_tokens += replayed
        self.proposer.verified(request, num_accepted)
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
