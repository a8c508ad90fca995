"""Engine roles for disaggregated serving: prefill hands requests off, decode receives them.

    prefill engine                             decode engine
    prompt computed, first token sampled
    hand_off: the request leaves the           prepare: validate; share the prefix blocks it
      scheduler but keeps its blocks and         already caches; allocate the rest and a live
      live slot, under a lease                   slot (the request waits, unschedulable)
           ---- KV blocks [held, n) + live Mamba state after the prompt (state_pos) ---->
    release on ack / abort / lease expiry      complete: cursor = prompt length; it joins the
                                                 running requests and decodes the first token
                                               fail: recompute locally or end with an error;
                                                 the destination pages stay quarantined until
                                                 no write can still be filling them

Ownership: prefill pages belong to the handoff until one of its three release events; while a
send reads them they are pinned, and a release that comes meanwhile (lease, abort) waits for
the send to end (`unpin`): freed pages may be reallocated and overwritten at once. Decode pages
belong to the receiving request, then to a quarantine, never straight to the pool while a
writer may be active.

A send pins its handoff's pages without the engine's lock (`PrefillHandoffs.source`): the
engine holds that lock for a whole step, and a prefill step can last a second on a busy CPU,
which every transfer would wait through before its first byte. The pages are known from the
hand-off, and a small lock of the handoffs' own makes pinning and releasing exclusive.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import (
    ReceivePlan,
    SamplingState,
    TransferRequest,
)
from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.cache.hashing import block_hashes
from hybridserve.workers.config import EngineConfig
from hybridserve.workers.model_runner import DTYPES
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.outputs import TokenLogprobs
from hybridserve.workers.parallel import local_conv_sections, local_kv_heads
from hybridserve.workers.request import Request
from hybridserve.workers.sampling_params import SamplingParams
from hybridserve.workers.scheduler import Scheduler
from hybridserve.workers.structured_output import Grammar

logger = logging.getLogger(__name__)


class TransferRejected(ValueError):
    """The decode engine refuses a transfer; `code` is machine-readable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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


class PrefillHandoffs:
    """Requests this prefill engine has finished and is holding for a transfer."""

    def __init__(
        self,
        scheduler: Scheduler,
        cache: CacheCoordinator,
        *,
        lease_seconds: float,
        compatibility_hash: str,
    ) -> None:
        self.scheduler = scheduler
        self.cache = cache
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

    def take_new(self) -> list[Handoff]:
        new, self._new = self._new, []
        return new

    def source(self, request_id: str) -> tuple[list[int], int] | None:
        """The blocks and live slot a pending handoff's data is read from, pinned until
        `unpin` (or a release by the sender); None once released. Safe without the engine's
        lock (the only call here that is)."""
        with self._lock:
            handoff = self.pending.get(request_id)
            if handoff is None or handoff.released is not None:
                return None
            handoff.pinned = True
            return list(handoff.block_ids), handoff.live_slot

    def unpin(self, request_id: str) -> None:
        """The send is over: a release that came meanwhile happens now."""
        with self._lock:
            handoff = self.pending.get(request_id)
            if handoff is None:
                return
            handoff.pinned = False
            deferred = handoff.released
        if deferred is not None:
            self.release(request_id, deferred)

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
        """Release every handoff whose lease has passed; called on a timer, not by scheduling."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                rid for rid, h in self.pending.items() if h.deadline <= now and h.released is None
            ]
        for request_id in expired:
            self.release(request_id, "lease expired")
        return expired


@dataclass
class Receiving:
    request: Request
    plan: ReceivePlan


@dataclass
class Quarantine:
    owner: str
    release_at: float


class DecodeReceives:
    """Transferred requests this decode engine is receiving."""

    def __init__(
        self,
        scheduler: Scheduler,
        cache: CacheCoordinator,
        *,
        vocab_size: int,
        max_model_len: int,
        compatibility_hash: str,
        failure_policy: str,
        compile: Callable[[SamplingParams], Grammar | None],
        quarantine_seconds: float = 5.0,
    ) -> None:
        """`compile` builds a request's grammar (structured output) from its parameters."""
        self.compile = compile
        self.scheduler = scheduler
        self.cache = cache
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.compatibility_hash = compatibility_hash
        self.failure_policy = failure_policy
        self.quarantine_seconds = quarantine_seconds
        self.receiving: dict[str, Receiving] = {}
        self.quarantined: list[Quarantine] = []
        self._quarantine_ids = 0

    def prepare(self, message: TransferRequest, live_ids: set[str]) -> ReceivePlan:
        """Validate a transfer and reserve its destination. Raises TransferRejected (and holds
        nothing) when it cannot be accepted."""
        request_id = message.request_id
        if request_id in live_ids or request_id in self.receiving:
            raise TransferRejected(
                "duplicate_request", f"request id {request_id!r} is already in use here"
            )
        if message.compatibility_hash != self.compatibility_hash:
            raise TransferRejected(
                "layout_mismatch",
                f"request {request_id}: compatibility hash "
                f"{message.compatibility_hash} does not match this engine's "
                f"{self.compatibility_hash} (model, dtypes, block size or layer layout differ)",
            )
        prompt = message.prompt_token_ids
        if message.state_pos != len(prompt) or not prompt:
            raise TransferRejected(
                "bad_state_pos",
                f"request {request_id}: state_pos {message.state_pos} must "
                f"equal the prompt length {len(prompt)}",
            )
        if len(prompt) + 1 > self.max_model_len:
            raise TransferRejected(
                "too_long",
                f"request {request_id}: {len(prompt)} prompt "
                f"tokens leave no room under max_model_len="
                f"{self.max_model_len}",
            )
        sampling = message.sampling
        lists = (sampling.stop_token_ids, sampling.choice_seeds, sampling.fork_token_ids)
        if not all(isinstance(v, list) for v in (*lists, sampling.first_logprobs)):
            raise TransferRejected(
                "invalid_request",
                f"request {request_id}: stop_token_ids, choice_seeds, fork_token_ids and "
                "first_logprobs must be lists",
            )
        bad = next(
            (
                t
                for t in (*prompt, message.first_token, *sampling.fork_token_ids)
                if not isinstance(t, int) or not 0 <= t < self.vocab_size
            ),
            None,
        )
        if bad is not None:
            raise TransferRejected(
                "invalid_request",
                f"request {request_id}: token id {bad!r} "
                f"is outside the vocabulary [0, {self.vocab_size})",
            )
        expected = block_hashes(prompt, self.cache.block_size, message.cache_salt)
        if [bytes(k) for k in expected] != [bytes(k) for k in message.block_hashes]:
            raise TransferRejected(
                "bad_block_hashes",
                f"request {request_id}: the block hashes "
                "do not match the prompt (stale or corrupted transfer)",
            )
        try:
            params = SamplingParams(**message.sampling.params)
        except (ValidationError, TypeError) as exc:
            raise TransferRejected(
                "invalid_request", f"request {request_id}: bad sampling parameters: {exc}"
            ) from exc
        integers = [sampling.sample_seed, *sampling.stop_token_ids, *sampling.choice_seeds]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in integers):
            # NOTE: the sampler would raise on them mid-step, taking every request down.
            raise TransferRejected(
                "invalid_request",
                f"request {request_id}: sample_seed, stop_token_ids and choice_seeds must be "
                f"integers, got {sampling.sample_seed!r}, {sampling.stop_token_ids!r} and "
                f"{sampling.choice_seeds!r}",
            )
        if len(sampling.choice_seeds) != params.n - 1 or len(sampling.fork_token_ids) not in (
            0,
            params.n - 1,
        ):
            raise TransferRejected(
                "invalid_request",
                f"request {request_id}: n={params.n} needs {params.n - 1} choice seeds and as "
                f"many forked first tokens, got {len(sampling.choice_seeds)} and "
                f"{len(sampling.fork_token_ids)}",
            )
        try:
            first_logprobs = [TokenLogprobs.from_wire(lp) for lp in sampling.first_logprobs]
            grammar = self.compile(params)
        except (TypeError, ValueError) as exc:
            raise TransferRejected(
                "invalid_request", f"request {request_id}: bad sampling state: {exc}"
            ) from exc
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            stop_token_ids=frozenset(sampling.stop_token_ids),
            sample_seed=sampling.sample_seed,
            cache_salt=message.cache_salt,
            choice_seeds=tuple(sampling.choice_seeds),
            fork_token_ids=tuple(sampling.fork_token_ids),
            grammar=grammar,
        )
        request.token_ids.append(message.first_token)
        if params.logprobs is not None and first_logprobs:
            request.logprobs.append(first_logprobs[0])
            request.fork_logprobs = tuple(first_logprobs[1:])
        else:
            request.fork_logprobs = (None,) * len(request.fork_token_ids)
        request.num_cached_tokens = message.num_cached_tokens
        reserved = self.cache.allocate_received(request, message.block_hashes, len(prompt))
        if reserved is None:
            raise TransferRejected(
                "no_capacity",
                f"request {request_id}: no room for {len(prompt)} tokens right now; retry later",
            )
        self.scheduler.start_receiving(request)
        held, allocation = reserved
        plan = ReceivePlan(
            request_id=request_id,
            held_blocks=held,
            dst_block_ids=allocation.new_block_ids,
            dst_slot=allocation.live_slot,
        )
        self.receiving[request_id] = Receiving(request, plan)
        return plan

    def complete(self, request_id: str) -> tuple[Request, list[Request]]:
        """The data has fully arrived: the request continues from the state after its prompt,
        and its other choices (n > 1) fork from it. Returns (the request, those choices)."""
        receiving = self.receiving.pop(request_id, None)
        if receiving is None:
            raise TransferRejected(
                "unknown_request", f"no transfer in progress for request {request_id!r}"
            )
        choices = self.scheduler.finish_receiving(receiving.request)
        return receiving.request, choices

    def fail(self, request_id: str, reason: str, *, writer_done: bool) -> Request | None:
        """A transfer failed. Its destination pages go to quarantine (released at once when no
        write can still arrive). Returns the request to recompute or to end with an error."""
        receiving = self.receiving.pop(request_id, None)
        if receiving is None:
            return None
        self._quarantine_ids += 1
        owner = f"quarantine-{self._quarantine_ids}:{request_id}"
        self.cache.rename(request_id, owner)
        delay = 0.0 if writer_done else self.quarantine_seconds
        self.quarantined.append(Quarantine(owner, time.monotonic() + delay))
        self.sweep()
        self.settle(receiving.request, reason)
        return receiving.request

    def settle(self, request: Request, reason: str) -> None:
        """The one decision for a request whose transfer failed, wherever the failure was
        seen (here while receiving, or by the prefill side before anything reached this
        engine): `transfer_failure_policy` recomputes it here or ends it with an error."""
        logger.warning(
            "request %s: transfer failed (%s); policy %s",
            request.request_id,
            reason,
            self.failure_policy,
        )
        self.scheduler.fail_receiving(
            request,
            recompute=self.failure_policy == "recompute",
            error=f"KV transfer failed: {reason}",
        )

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        keep = []
        for quarantine in self.quarantined:
            if quarantine.release_at <= now:
                self.cache.free_owner(quarantine.owner)
            else:
                keep.append(quarantine)
        self.quarantined = keep


def peer_layout(model: HybridModelConfig, config: EngineConfig, rank: int = 0) -> PeerLayout:
    """Rank `rank`'s transferable state, as the transceiver describes it to a peer: its own
    KV heads, conv sections and SSM heads (docs/tensor-parallel.md)."""
    attention, mamba = model.attention, model.mamba
    tp = config.tensor_parallel_size
    model_id = hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:16]
    kv_heads = local_kv_heads(attention, tp) if attention else 0
    return PeerLayout(
        model_id=model_id,
        tp_size=tp,
        tp_rank=rank,
        layer_kinds=model.layer_kinds,
        kv_heads_per_layer=tuple(
            kv_heads if kind == "attention" else 0 for kind in model.layer_kinds
        ),
        num_kv_heads=attention.num_kv_heads if attention else 0,
        block_size=config.block_size,
        head_dim=attention.head_dim if attention else 0,
        kv_dtype=str(DTYPES[config.dtype]) if attention else "none",
        conv_sections=local_conv_sections(mamba, tp) if mamba else (0, 0, 0),
        mamba_groups=mamba.n_groups if mamba else 0,
        conv_width=mamba.conv_kernel - 1 if mamba else 0,
        conv_dtype=str(DTYPES[config.dtype]) if mamba else "none",
        ssm_heads=mamba.num_heads // tp if mamba else 0,
        ssm_head_dim=mamba.head_dim if mamba else 0,
        ssm_state_size=mamba.state_size if mamba else 0,
        ssm_dtype=str(DTYPES[config.mamba_ssm_dtype]) if mamba else "none",
    )
