"""Scheduler: who runs this step and how many tokens each gets. No tensors here.

Every step has a token budget (`max_num_batched_tokens`). Running requests go first, those with
a single token left (decodes) ahead of unfinished prompt chunks, so decodes never wait behind a
long prefill; then waiting requests are admitted in arrival order while the budget, the
sequence limit and the cache allow. A chunk is whatever part of [num_computed, num_tokens) fits.

When the KV pool runs dry for a running request, the most recently admitted request is
preempted: its blocks and slot are freed and it goes back to the front of the queue to be
recomputed from scratch (its tokens so far become its new "prompt" work; sampling is seeded
by position, so it produces the same tokens again).

Speculative decoding (with a `Speculator`): a running request whose chunk reaches the end of
its known tokens also verifies the proposer's drafts, if the budget and its pools allow (a
request is never preempted for drafts). Its live state is checkpointed first; after the step
the tokens that stand are appended, and when a draft was rejected (or the request ended
inside the span) the state goes back to the checkpoint and the cursor to the chunk's start,
so the live state always matches the cursor and nothing commits a state past a rejected
token.

Disaggregated requests stay here as states: a prefill engine's request that is handed off
(its pages held for the transfer) and a decode engine's request whose state is still arriving
sit in `transferring`, never scheduled and never preempted, until the scheduler's own
transitions (`release_handoff`, `finish_receiving`, `fail_receiving`) move them on.

The output of `schedule` carries a `StepPlan` (step_plan.py): the value every model runner
executes, so nothing below the scheduler reads a `Request` or asks the cache anything.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.core.outputs import FinishReason, Sample, TokenLogprobs
from hybridserve.workers.core.request import Request, RequestStatus
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.step_plan import (
    PENDING_TOKEN,
    SamplingRow,
    ScheduledChunk,
    StepPlan,
)
from hybridserve.workers.speculative.proposer import Speculator

logger = logging.getLogger(__name__)


# Not frozen, for the reason ScheduledChunk is not (step_plan.py): one per running request per
# step.
@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    num_draft_tokens: int = 0

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the known tokens, so its last logits are sampled."""
        request = self.request
        known = self.num_new_tokens - self.num_draft_tokens
        return request.num_computed_tokens + known == request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # What the model runners execute; built once scheduling is done.
    plan: StepPlan = field(default_factory=StepPlan)
    # New tokens over `scheduled`, kept by add / drop: the budget check reads it once per
    # request, and summing the batch each time made a 256-request step quadratic.
    num_tokens: int = 0

    def add(self, request: Request, num_new_tokens: int, num_draft_tokens: int = 0) -> None:
        self.scheduled.append(ScheduledRequest(request, num_new_tokens, num_draft_tokens))
        self.num_tokens += num_new_tokens

    def drop(self, request: Request) -> None:
        """Take `request` out of this step's batch, if it is in it."""
        kept = [s for s in self.scheduled if s.request is not request]
        if len(kept) != len(self.scheduled):
            self.scheduled = kept
            self.num_tokens = sum(s.num_new_tokens for s in kept)


class Scheduler:
    def __init__(
        self,
        cache: CacheCoordinator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        fork_on_sample: bool = True,
        speculator: Speculator | None = None,
    ) -> None:
        self.cache = cache
        self.speculator = speculator
        # n > 1 choices fork where their first tokens are drawn; a prefill engine leaves that
        # to the decode engine it hands the request to (fork_received).
        self.fork_on_sample = fork_on_sample
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        # Handed off (prefill role) or receiving (decode role): holding pages for a transfer.
        self.transferring: dict[str, Request] = {}
        # Since start, for metrics and tests: preemptions, prompt tokens run through the model
        # (recomputation included, reuse and received state not) and choices forked in place.
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_forks = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # The cache coordinator says where this pass's chunks must end, before every pass
        # (docs/snapshot-reuse.md).
        for request in (*self.running, *self.waiting):
            if request.num_computed_tokens < len(request.prompt_token_ids):
                request.expect_snapshot_points = self.cache.snapshot_points(request)
        # 1. Running requests: decodes first, then unfinished chunks, each in admission order.
        for request in sorted(self.running, key=_not_decoding):
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            computed = request.num_computed_tokens
            if computed >= len(request.prompt_token_ids):
                # Past the prompt (a decode, a recompute's outputs): no snapshot points.
                num_new = min(len(request.token_ids) - computed, budget)
            else:
                num_new = self.chunk_size(request, budget, computed)
            if num_new and self._allocate_or_preempt(request, num_new, out):
                out.add(request, num_new)
        if self.speculator is not None:
            self._add_drafts(out)
        # 2. Waiting requests in arrival order, unless this step already had to preempt (memory
        #    is short). Each first looks up its reusable prefix and starts after it, or waits
        #    while a running prompt is about to commit a deeper one on its path.
        held: list[Request] = []
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._still_waits(request):
                held.append(self.waiting.popleft())
                continue
            reuse = self.cache.find_reuse(request)
            if self._waits_for_prefix(request, reuse.num_tokens):
                held.append(self.waiting.popleft())
                continue
            budget = self.max_num_batched_tokens - out.num_tokens
            num_new = self.chunk_size(request, budget, reuse.num_tokens)
            if (
                num_new == 0
                or self.cache.allocate(
                    request, self._room(request, num_new, reuse.num_tokens), reuse
                )
                is None
            ):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.queued_s is None:
                request.queued_s = time.monotonic() - request.arrival_time
            self.running.append(request)
            out.add(request, num_new)
        self.waiting.extendleft(reversed(held))
        chunks = [self._chunk(s) for s in out.scheduled]
        out.plan = StepPlan(chunks, self.cache.take_ops(), self.cache.take_released())
        return out

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Drafts to verify after the chunks of this step that reach the end of their known
        tokens, in one proposal for all of them, as far as the budget and the pools allow (a
        request is never preempted for drafts)."""
        assert self.speculator is not None
        budget = self.max_num_batched_tokens - out.num_tokens
        batch: list[tuple[int, int]] = []  # (index in out.scheduled, at most this many)
        for index, item in enumerate(out.scheduled):
            request = item.request
            if not item.samples or request.num_output_tokens == 0:
                continue  # its first token comes from the prompt
            # The step yields the accepted drafts and one more token: no more than the
            # request may still generate.
            limit = min(
                budget,
                self.speculator.config.num_speculative_tokens,
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if limit > 0:
                batch.append((index, limit))
                budget -= limit
        if not batch:
            return
        proposals = self.speculator.drafts(
            [(out.scheduled[i].request, limit) for i, limit in batch], len(self.running)
        )
        for (index, _), drafts in zip(batch, proposals, strict=True):
            item = out.scheduled[index]
            request = item.request
            total = item.num_new_tokens + len(drafts)
            if not (
                drafts
                and self.cache.can_checkpoint(request)
                and self.cache.allocate(request, total) is not None
            ):
                self.speculator.dropped(request)
                continue
            self.cache.checkpoint(request)
            request.draft_token_ids = drafts
            out.scheduled[index] = ScheduledRequest(request, total, len(drafts))
            out.num_tokens += len(drafts)

    def _waits_for_prefix(self, request: Request, num_reusable: int) -> bool:
        """Whether `request` waits for a prompt in flight that shares at least one more block
        with it to commit its snapshot there: computing those tokens again, in the same steps,
        would cost as much as the prompt ahead spends on them. It waits at most until that
        prompt passes the point, which it does within a few steps of its own (a preempted
        one no longer counts as in flight), so nothing waits for ever."""
        ahead = self.cache.reuse_in_flight(request, self.running)
        if ahead is None or ahead.position < num_reusable + self.cache.block_size:
            return False
        request.prefix_wait = ahead
        return True

    def _still_waits(self, request: Request) -> bool:
        """Whether the prompt `request` waits for is still running short of its point: then
        nothing `request` could reuse has changed since the last step, and its lookup is not
        repeated (many requests of one burst may wait on one prompt, step after step)."""
        wait = request.prefix_wait
        if wait is None:
            return False
        ahead = wait.request
        if ahead.status is RequestStatus.RUNNING and ahead.num_computed_tokens < wait.position:
            return True
        request.prefix_wait = None
        return False

    def _chunk(self, item: ScheduledRequest) -> ScheduledChunk:
        # Built for every running request at every step: positional arguments and no
        # property chains (docs/benchmarks.md, the host's cost per request).
        request = item.request
        request_id = request.request_id
        start = request.num_computed_tokens
        end = start + item.num_new_tokens - item.num_draft_tokens
        token_ids = request.token_ids
        drafts = request.draft_token_ids
        # A chunk that reaches the end of the known tokens samples the next one.
        rows = _sampling_rows(request, drafts) if end == len(token_ids) else (None,)
        table_from, block_ids = self.cache.table_update(request_id)
        scores = request.sampling_params.prompt_logprobs
        if scores is not None and start >= request.num_prompt_tokens - 1:
            scores = None
        return ScheduledChunk(
            request_id,
            token_ids[start:end] + drafts if drafts else token_ids[start:end],
            start,
            block_ids,
            self.cache.live_slot(request_id),
            rows[0],
            scores,
            # The token after the chunk: what its last row scores (prompt logprobs), and the
            # input of the MTP layers at its last position.
            token_ids[end] if end < len(token_ids) else None,
            tuple(rows[1:]),  # type: ignore[arg-type]
            table_from,
        )

    def chunk_size(self, request: Request, budget: int, position: int) -> int:
        """Tokens to compute from `position` this step; 0 = not this step.

        Without prefix caching: whatever fits. With it (FORCE_CHUNK): run to the next
        snapshot point or to the end; only the budget may cut that short, and then the chunk is
        rounded down to whole blocks. A chunk ending at a point or at the end is never rounded.
        """
        remaining = request.num_tokens - position
        if not self.cache.enabled or position >= request.num_prompt_tokens:
            # Snapshot points lie inside the prompt: past it, whatever fits.
            return min(remaining, budget)
        points = request.expect_snapshot_points
        if points is None:
            raise RuntimeError(
                f"FORCE_CHUNK requires expect_snapshot_points to be set before "
                f"scheduling request {request.request_id}"
            )
        next_point = next((p for p in points if p > position), None)
        chunk = (
            remaining
            if next_point is None
            else max(0, min(next_point, request.num_prompt_tokens) - position)
        )
        chunk = min(chunk, budget)
        end = position + chunk
        if chunk < remaining and end < request.num_prompt_tokens and end not in points:
            chunk = chunk // self.cache.block_size * self.cache.block_size
        return chunk

    def _room(self, request: Request, num_new: int, position: int) -> int:
        """Tokens to allocate for a chunk of `num_new` from `position`: with a proposer that
        writes KV ahead of the request (MTP layers guessing at the end of the step), as many
        positions more as it writes, within max_model_len, when the chunk reaches the end."""
        if self.speculator is None or position + num_new != request.num_tokens:
            return num_new
        ahead = self.speculator.proposer.lookahead
        return num_new + max(0, min(ahead, self.max_model_len - request.num_tokens))

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for `request`, preempting newer requests until it fits. False if `request`
        itself had to be preempted."""
        room = self._room(request, num_new, request.num_computed_tokens)
        while self.cache.allocate(request, room) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            # Decodes are scheduled out of admission order, so the victim may already be in
            # this step's batch: take it out again (its blocks were just freed).
            out.drop(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.draft_token_ids = []
        if self.speculator is not None:
            self.speculator.release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "request %s preempted (KV pool full); it will be recomputed", request.request_id
        )

    def advance(self, out: SchedulerOutput) -> None:
        """Move the step's cursors past what its chunks compute, and commit what that
        completes (a snapshot point reached, its prompt blocks). Neither needs the step's
        result: with async scheduling a step advances as soon as it is handed to the ranks,
        so its commits' copies go with the next plan, before anything computes past them.
        A verify chunk moves its cursor in `settle`, where its accepted drafts are known."""
        for item in out.scheduled:
            if item.num_draft_tokens:
                continue
            request = item.request
            computed = request.num_computed_tokens
            request.num_computed_tokens = computed + item.num_new_tokens
            prompt_len = request.num_prompt_tokens
            if computed < prompt_len:
                self.num_prompt_tokens_computed += (
                    min(request.num_computed_tokens, prompt_len) - computed
                )
            self.cache.commit(request)

    def can_run_ahead(self, out: SchedulerOutput) -> bool:
        """Whether the next step can be built before `out`'s tokens are known: no request
        that samples in it needs its token to build its next row (a grammar's mask, penalties'
        counts, the choices an n > 1 request forks from its first token, drafts)."""
        for item, chunk in zip(out.scheduled, out.plan.chunks, strict=True):
            request = item.request
            if chunk.sampling is not None and (
                item.num_draft_tokens
                or request.grammar is not None
                or request.sampling_params.uses_penalties
                or (request.choice_seeds and request.num_output_tokens == 0)
            ):
                return False
        return True

    def run_ahead(self, out: SchedulerOutput) -> None:
        """Async scheduling, before `out`'s samples are known (`advance` done): each request
        that samples in it gets a placeholder for that token (PENDING_TOKEN), which the next
        schedule gives it to compute. The rank puts the token it sampled in its place;
        `settle` writes it here."""
        for item, chunk in zip(out.scheduled, out.plan.chunks, strict=True):
            if chunk.sampling is not None and item.request.status is RequestStatus.RUNNING:
                item.request.token_ids.append(PENDING_TOKEN)

    def settle(self, out: SchedulerOutput, samples: list[Sample | None]) -> list[Request]:
        """The step's samples: append each request's token (in place of its placeholder when
        the next step ran ahead), fork the choices of n > 1 requests, stop the requests they
        end; return the requests that changed visibly (got a token or finished), new choices
        included. A request that ended while the step ran (aborted, or stopped by the token of
        the step before, learned one step late) takes nothing from it."""
        changed = []
        for item, sample in zip(out.scheduled, samples, strict=True):
            request = item.request
            if sample is None or request.is_finished:
                continue
            if item.num_draft_tokens:
                self._settle_drafts(request, item, sample)
                changed.append(request)
                continue
            tokens = sample.token_ids
            logprobs = sample.logprobs or (None,) * len(tokens)
            if len(tokens) > 1:
                forks = list(zip(tokens[1:], logprobs[1:], strict=True))
                if self.fork_on_sample:
                    changed += self.fork(request, forks)
                else:
                    # Handed to the decode engine, which forks them and decides whether this
                    # first token ends the request (finish_receiving).
                    request.fork_token_ids = tokens[1:]
                    request.fork_logprobs = logprobs[1:]
            self._append(
                request, tokens[0], logprobs[0], may_finish=len(tokens) == 1 or self.fork_on_sample
            )
            changed.append(request)
        return changed

    def _settle_drafts(self, request: Request, item: ScheduledRequest, sample: Sample) -> None:
        """After a verify step: append the tokens that stand (up to the first that ends the
        request). The live state stays where the step left it only if it is the state after
        exactly the tokens that stand; otherwise the checkpoint goes back and the cursor to
        the chunk's start, before anything (a turn-end commit) reads the state."""
        num_drafts = item.num_draft_tokens
        request.draft_token_ids = []
        tokens = [*sample.accepted, sample.token_ids[0]]
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if sample.logprobs is not None:
            logprobs = [*(sample.accepted_logprobs or ()), sample.logprobs[0]]
        # The tokens kept: up to the first that ends the request.
        kept = next(
            (
                i + 1
                for i, token in enumerate(tokens)
                if self._finish_reason_at(
                    request, token, request.num_output_tokens + i + 1, request.num_tokens + i + 1
                )
            ),
            len(tokens),
        )
        rolled_back = not (len(sample.accepted) == num_drafts and kept >= num_drafts)
        if rolled_back:
            self.cache.rollback(request)
        else:
            request.num_computed_tokens += item.num_new_tokens
            self.cache.release_checkpoint(request)
        for token, token_logprobs in zip(tokens[:kept], logprobs[:kept], strict=True):
            self._append(request, token, token_logprobs)
        # What the replay costs: the known tokens and accepted drafts this step computed,
        # computed again by the next (none once the request ended).
        replayed = 0
        if rolled_back and not request.is_finished:
            replayed = item.num_new_tokens - num_drafts + len(sample.accepted)
        assert self.speculator is not None
        self.speculator.record(request, num_drafts, len(sample.accepted), replayed)

    def _append(
        self,
        request: Request,
        token: int,
        logprobs: TokenLogprobs | None,
        *,
        may_finish: bool = True,
    ) -> None:
        """A new output token (in place of its placeholder, if it has one); finish the request
        if it ends it."""
        if request.token_ids[-1] == PENDING_TOKEN:
            request.token_ids[-1] = token
        else:
            request.token_ids.append(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.grammar is not None:
            request.grammar.accept(token)
        if may_finish:
            self._finish_if_done(request)

    def _finish_if_done(self, request: Request) -> None:
        reason = self._finish_reason(request, request.token_ids[-1])
        if reason is not None:
            self.finish(request, reason)

    def fork(
        self, request: Request, firsts: list[tuple[int, TokenLogprobs | None]]
    ) -> list[Request]:
        """The other choices of `request`, each continuing from its state after the prompt
        with its own first token (drawn from the prompt's last row with its own seed). A choice
        the pools cannot hold now waits to be recomputed, like a preempted request."""
        choices = []
        for index, (token, logprobs) in enumerate(firsts, start=1):
            choice = request.new_choice(index)
            if self.cache.fork(request, choice):
                self.num_forks += 1
                choice.status = RequestStatus.RUNNING
                choice.num_computed_tokens = request.num_computed_tokens
                self.running.append(choice)
            else:
                logger.info(
                    "request %s: choice %d waits for room (recomputed)", request.request_id, index
                )
                self.waiting.appendleft(choice)
            self._append(choice, token, logprobs)
            choices.append(choice)
        return choices

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        return self._finish_reason_at(request, token, request.num_output_tokens, request.num_tokens)

    def _finish_reason_at(
        self, request: Request, token: int, num_output_tokens: int, num_tokens: int
    ) -> FinishReason | None:
        """Why `request` ends with `token` as its last token, once it has `num_output_tokens`
        output tokens of `num_tokens` in all (None: it goes on)."""
        params = request.sampling_params
        if token in request.stop_token_ids and num_output_tokens > params.min_tokens:
            return "stop"
        if num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request from wherever it is and release everything it holds."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.transferring.pop(request.request_id, None)
        if reason in ("stop", "length"):
            self.cache.commit_turn_end(request)
        self.cache.free(request)
        if self.speculator is not None:
            self.speculator.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ---- disaggregation: the transfer states ------------------------------------------------

    def hand_off(self, request: Request) -> None:
        """Prefill role: a request that just sampled its first token leaves the running set
        but keeps its blocks and live slot (now holding the state after the whole prompt)
        for the transfer, until `release_handoff`."""
        assert request.status is RequestStatus.RUNNING
        self.running.remove(request)
        request.status = RequestStatus.HANDED_OFF
        self.transferring[request.request_id] = request

    def release_handoff(self, request: Request) -> None:
        """The transfer is over (ack, abort or lease expiry): free the handoff's pages."""
        del self.transferring[request.request_id]
        self.cache.free(request)
        request.status = RequestStatus.FINISHED

    def start_receiving(self, request: Request) -> None:
        """Decode role: a request whose pages the cache coordinator just reserved; its state
        is arriving, so it is not scheduled until `finish_receiving`."""
        request.status = RequestStatus.RECEIVING
        self.transferring[request.request_id] = request

    def finish_receiving(self, request: Request) -> list[Request]:
        """The state after the prompt has fully arrived: the request continues from there,
        and the choices its prefill engine drew fork from it here. Returns those choices."""
        del self.transferring[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        request.expect_snapshot_points = self.cache.snapshot_points(request)
        self.cache.commit(request)  # the received prompt becomes reusable here too
        self.running.append(request)
        forks = list(zip(request.fork_token_ids, request.fork_logprobs, strict=True))
        request.fork_token_ids, request.fork_logprobs = (), ()
        choices = self.fork(request, forks) if forks else []
        # The prefill engine sampled the first token; its grammar state starts after it here
        # (taken after the forks, which start from the state before it).
        if request.grammar is not None:
            request.grammar.accept(request.token_ids[-1])
        if forks:
            self._finish_if_done(request)  # the prefill engine left that to this engine
        return choices

    def fail_receiving(self, request: Request, *, recompute: bool, error: str) -> None:
        """The transfer failed (its pages, if it had any here, went to a quarantine): recompute
        the request here from scratch, or end it with `error`."""
        self.transferring.pop(request.request_id, None)
        if recompute:
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            self.waiting.appendleft(request)
        else:
            request.status = RequestStatus.FINISHED
            request.finish_reason = "error"
            request.error = error


def _not_decoding(request: Request) -> bool:
    """Sort key: decodes (one token left to compute) first."""
    return len(request.token_ids) - request.num_computed_tokens > 1


def _sampling_rows(request: Request, drafts: list[int]) -> list[SamplingRow]:
    """The row that samples `request`'s next token, then with drafts the row after each of
    them: banned stop tokens, penalties and grammar mask as if the drafts before it stood
    (the sampler mixes each row's seeds with the position it draws)."""
    if request.sampling_row is not None:
        # Built once nothing about the row could change any more (below): output positions
        # only grow, and the rest is fixed for the request's life.
        return [request.sampling_row] * (len(drafts) + 1)
    params = request.sampling_params
    first = request.num_output_tokens
    if (
        request.grammar is None
        and not params.uses_penalties
        and first >= params.min_tokens
        and not (first == 0 and request.choice_seeds)
    ):
        # Nothing about the row changes from step to step: one value serves them all.
        request.sampling_row = _row(params, (request.sample_seed,))
        return [request.sampling_row] * (len(drafts) + 1)
    penalised = params.uses_penalties
    outputs = request.output_token_ids + drafts if penalised else []
    prompt_ids = tuple(request.prompt_token_ids) if params.repetition_penalty != 1.0 else ()
    masks: list[bytes | None] = [None] * (len(drafts) + 1)
    if request.grammar is not None:
        masks = list(request.grammar.bitmasks_along(drafts))
    rows = []
    for offset, mask in enumerate(masks):
        position = first + offset
        # The first draw of an n > 1 request also draws its other choices' first tokens.
        seeds = (request.sample_seed,)
        if position == 0 and request.choice_seeds:
            seeds += request.choice_seeds
        rows.append(
            _row(
                params,
                seeds,
                banned_token_ids=(
                    tuple(request.stop_token_ids) if position < params.min_tokens else ()
                ),
                output_token_ids=tuple(outputs[: len(outputs) - len(drafts) + offset]),
                prompt_token_ids=prompt_ids,
                allowed_token_bitmask=mask,
            )
        )
    return rows


def _row(
    params: SamplingParams,
    seeds: tuple[int, ...],
    *,
    banned_token_ids: tuple[int, ...] = (),
    output_token_ids: tuple[int, ...] = (),
    prompt_token_ids: tuple[int, ...] = (),
    allowed_token_bitmask: bytes | None = None,
) -> SamplingRow:
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seeds=seeds,
        min_p=params.min_p,
        banned_token_ids=banned_token_ids,
        logit_bias=params.logit_bias,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        output_token_ids=output_token_ids,
        prompt_token_ids=prompt_token_ids,
        allowed_token_bitmask=allowed_token_bitmask,
        num_logprobs=params.logprobs,
    )
