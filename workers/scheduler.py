"""Scheduler: who runs this step and how many tokens each gets. No tensors here.

Every step has a token budget (`max_num_batched_tokens`). Running requests go first, those with
a single token left (decodes) ahead of unfinished prompt chunks, so decodes never wait behind a
long prefill; then waiting requests are admitted in arrival order while the budget, the
sequence limit and the cache allow. A chunk is whatever part of [num_computed, num_tokens) fits.

When the KV pool runs dry for a running request, the most recently admitted request is
preempted: its blocks and slot are freed and it goes back to the front of the queue to be
recomputed from scratch (its tokens so far become its new "prompt" work; sampling is seeded
by position, so it produces the same tokens again).

Disaggregated requests stay here as states: a prefill engine's request that is handed off
(its pages held for the transfer) and a decode engine's request whose state is still arriving
sit in `transferring`, never scheduled and never preempted, until the scheduler's own
transitions (`release_handoff`, `finish_receiving`, `fail_receiving`) move them on.

The output of `schedule` carries a `StepPlan` (step_plan.py): the value every model runner
executes, so nothing below the scheduler reads a `Request` or asks the cache anything.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.outputs import FinishReason
from hybridserve.workers.request import Request, RequestStatus
from hybridserve.workers.step_plan import SamplingRow, ScheduledChunk, StepPlan, mix_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the known tokens, so its last logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # What the model runners execute; built once scheduling is done.
    plan: StepPlan = field(default_factory=StepPlan)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        cache: CacheCoordinator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        # Handed off (prefill role) or receiving (decode role): holding pages for a transfer.
        self.transferring: dict[str, Request] = {}
        self.num_preemptions = 0  # since start, for metrics

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # The cache coordinator says where this pass's chunks must end, before every pass
        # (docs/snapshot-reuse.md).
        for request in (*self.running, *self.waiting):
            if request.num_computed_tokens < request.num_prompt_tokens:
                request.expect_snapshot_points = self.cache.snapshot_points(request)
        # 1. Running requests: decodes first, then unfinished chunks, each in admission order.
        for request in sorted(self.running, key=lambda r: r.num_remaining_tokens > 1):
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self.chunk_size(request, budget, request.num_computed_tokens)
            if num_new and self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append(ScheduledRequest(request, num_new))
        # 2. Waiting requests in arrival order, unless this step already had to preempt (memory
        #    is short). Each first looks up its reusable prefix and starts after it.
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            reuse = self.cache.find_reuse(request)
            budget = self.max_num_batched_tokens - out.num_tokens
            num_new = self.chunk_size(request, budget, reuse.num_tokens)
            if num_new == 0 or self.cache.allocate(request, num_new, reuse) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
        out.plan = StepPlan([self._chunk(s) for s in out.scheduled], self.cache.take_ops())
        return out

    def _chunk(self, item: ScheduledRequest) -> ScheduledChunk:
        request = item.request
        start = request.num_computed_tokens
        request_id = request.request_id
        return ScheduledChunk(
            request_id=request_id,
            token_ids=request.token_ids[start : start + item.num_new_tokens],
            start=start,
            block_ids=list(self.cache.block_table(request_id)),
            slot=self.cache.live_slot(request_id),
            sampling=_sampling_row(request) if item.samples else None,
            keep_logits=request.keep_logits,
        )

    def chunk_size(self, request: Request, budget: int, position: int) -> int:
        """Tokens to compute from `position` this step; 0 = not this step.

        Without prefix caching: whatever fits. With it (FORCE_CHUNK): run to the next
        snapshot point or to the end; only the budget may cut that short, and then the chunk is
        rounded down to whole blocks. A chunk ending at a point or at the end is never rounded.
        """
        remaining = request.num_tokens - position
        if not self.cache.enabled:
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

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for `request`, preempting newer requests until it fits. False if `request`
        itself had to be preempted."""
        while self.cache.allocate(request, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            # Decodes are scheduled out of admission order, so the victim may already be in
            # this step's batch: take it out again (its blocks were just freed).
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "request %s preempted (KV pool full); it will be recomputed", request.request_id
        )

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Advance cursors after the model ran; append sampled tokens; return requests that
        changed visibly (got a token or finished)."""
        changed = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.cache.commit(request)
            if token is None:
                continue
            request.token_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
            changed.append(request)
        return changed

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if token in request.stop_token_ids and request.num_output_tokens > params.min_tokens:
            return "stop"
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
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

    def finish_receiving(self, request: Request) -> None:
        """The state after the prompt has fully arrived: the request continues from there."""
        del self.transferring[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        request.expect_snapshot_points = self.cache.snapshot_points(request)
        self.cache.commit(request)  # the received prompt becomes reusable here too
        self.running.append(request)

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


def _sampling_row(request: Request) -> SamplingRow:
    params = request.sampling_params
    banned = tuple(request.stop_token_ids) if request.num_output_tokens < params.min_tokens else ()
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=mix_seed(request.sample_seed, request.num_output_tokens),
        banned_token_ids=banned,
    )
