"""The prefill role of an engine: requests held for their transfer after the first token.

`Engine.prefill_port` exists on prefill engines only; the transfer sender
(transceiver/endpoint.py) reads a hand-off's pages and releases it through it. See the
package's docstring for the life cycle and the ownership of pages."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridserve.transceiver.protocol import (
    SamplingState,
    TransferRequest,
)
from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.cache.hashing import block_hashes
from hybridserve.workers.core.request import Request
from hybridserve.workers.core.scheduler import Scheduler

if TYPE_CHECKING:
    from hybridserve.workers.core.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class Handoff:
    request: Request
    message: TransferRequest
    deadline: float  # monotonic seconds; the lease
    # Where its data is read from: its KV blocks and live slot, fixed until its release.
    block_ids: tuple[int, ...]
    live_slot: int
    pinned: bool = False  # a send is reading its pages
    released: str | None = None  # released while pinned: why (freed once unpinned)


class PrefillPort:
    """Requests this prefill engine has finished and is holding for a transfer. Every method
    but `handoff_source` runs under the engine's lock."""

    def __init__(self, engine: Engine, *, lease_seconds: float, compatibility_hash: str) -> None:
        self.engine = engine
        self.scheduler: Scheduler = engine.scheduler
        self.cache: CacheCoordinator = engine.cache
        self.lease_seconds = lease_seconds
        self.compatibility_hash = compatibility_hash
        self.pending: dict[str, Handoff] = {}
        self._new: list[Handoff] = []
        # Pinning (a sender's thread) against releasing (the engine's, or a sender's): taken
        # for the check and the flag, never across anything slow.
        self._lock = threading.Lock()

    def hand_off(self, request: Request) -> Handoff:
        """Take a request that just sampled its first token out of the scheduler, keeping its
        blocks and live slot (now holding the state after the whole prompt)."""
        self.scheduler.hand_off(request)
        params = request.sampling_params
        message = TransferRequest(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            block_hashes=list(
                block_hashes(request.prompt_token_ids, self.cache.block_size, request.cache_salt)
            ),
            cache_salt=request.cache_salt,
            state_pos=request.num_prompt_tokens,
            first_token=request.token_ids[request.num_prompt_tokens],
            sampling=SamplingState(
                params=params.model_dump(mode="json"),
                sample_seed=request.sample_seed,
                stop_token_ids=sorted(request.stop_token_ids),
                choice_seeds=list(request.choice_seeds),
                fork_token_ids=list(request.fork_token_ids),
                first_logprobs=[
                    lp.to_wire() for lp in (*request.logprobs, *request.fork_logprobs) if lp
                ],
                draft_token_ids=(
                    list(request.speculation.pending) if request.speculation is not None else []
                ),
            ),
            num_cached_tokens=request.num_cached_tokens,
            compatibility_hash=self.compatibility_hash,
        )
        assert request.num_computed_tokens == request.num_prompt_tokens
        handoff = Handoff(
            request,
            message,
            time.monotonic() + self.lease_seconds,
            tuple(self.cache.block_table(request.request_id)),
            self.cache.live_slot(request.request_id),
        )
        with self._lock:
            self.pending[request.request_id] = handoff
        self._new.append(handoff)
        return handoff

    def take_handoffs(self) -> list[Handoff]:
        """Requests handed off since the last call (each holds its pages until
        `release_handoff` or its lease expires)."""
        new, self._new = self._new, []
        return new

    def holds(self, request_id: str) -> bool:
        """Whether a hand-off of `request_id` still holds pages here (its id is taken until
        they are freed, an aborted one's too)."""
        return request_id in self.pending

    def handoff_source(self, request_id: str) -> tuple[list[int], int] | None:
        """The blocks and live slot a pending handoff's data is read from, pinned until
        `unpin_handoff` (or a release by the sender); None once released. Safe without the
        engine's lock (the only call here that is): the engine holds it for a whole step,
        which every transfer would wait through before its first byte."""
        with self._lock:
            handoff = self.pending.get(request_id)
            if handoff is None or handoff.released is not None:
                return None
            handoff.pinned = True
            return list(handoff.block_ids), handoff.live_slot

    def unpin_handoff(self, request_id: str) -> None:
        """The send is over, but its pages wait for the lease (a one-sided write may still
        read them), or go now if the lease or an abort already released the handoff."""
        with self._lock:
            handoff = self.pending.get(request_id)
            if handoff is None:
                return
            handoff.pinned = False
            deferred = handoff.released
        if deferred is not None:
            self.release(request_id, deferred)

    def release_handoff(self, request_id: str, reason: str) -> bool:
        """The sender is done with a handoff (acked, rejected, failed): its pages go now."""
        # A release that came during the send (lease, abort) happens here, and that one has
        # taken the request out of the engine already.
        self.unpin_handoff(request_id)
        released = self.release(request_id, reason)
        if released:
            self.engine.requests.pop(request_id, None)
        return released

    def release(self, request_id: str, reason: str) -> bool:
        """Ack, abort or expiry: free the handoff's pages (once no send reads them). False if
        it was already released (release is idempotent: a late ack after an abort changes
        nothing)."""
        with self._lock:
            handoff = self.pending.get(request_id)
            if handoff is None or (handoff.pinned and handoff.released is not None):
                return False
            if handoff.pinned:
                handoff.released = reason
                logger.info(
                    "request %s: handoff released (%s) once its send ends", request_id, reason
                )
                return True
            del self.pending[request_id]
        self.scheduler.release_handoff(handoff.request)
        logger.info("request %s: handoff released (%s)", request_id, reason)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Release every handoff whose lease has passed, and let their requests go from the
        engine; called on every step, idle ones too, not by scheduling."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                rid for rid, h in self.pending.items() if h.deadline <= now and h.released is None
            ]
        for request_id in expired:
            self.release(request_id, "lease expired")
            self.engine.requests.pop(request_id, None)
        return expired
