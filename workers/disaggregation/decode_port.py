"""The decode role of an engine: requests received from a prefill engine.

`Engine.decode_port` exists on decode engines only; the transfer receiver
(transceiver/endpoint.py) reserves, completes and fails receives through it, and the engine
host recovers a transfer the prefill side lost. See the package's docstring for the life
cycle and the ownership of pages."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from hybridserve.transceiver.protocol import (
    ReceivePlan,
    TransferRequest,
)
from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.cache.hashing import block_hashes
from hybridserve.workers.core.outputs import RequestOutput, TokenLogprobs
from hybridserve.workers.core.request import Request
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.scheduler import Scheduler
from hybridserve.workers.speculative.proposer import hold_drafts

if TYPE_CHECKING:
    from hybridserve.workers.core.engine import Engine

logger = logging.getLogger(__name__)


class TransferRejected(ValueError):
    """The decode engine refuses a transfer; `code` is machine-readable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Receiving:
    request: Request
    plan: ReceivePlan


@dataclass
class Quarantine:
    owner: str
    release_at: float


class DecodePort:
    """Transferred requests this decode engine is receiving. Every method runs under the
    engine's lock."""

    def __init__(
        self,
        engine: Engine,
        *,
        compatibility_hash: str,
        failure_policy: str,
        quarantine_seconds: float = 5.0,
    ) -> None:
        self.engine = engine
        self.scheduler: Scheduler = engine.scheduler
        self.cache: CacheCoordinator = engine.cache
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.max_model_len
        self.compatibility_hash = compatibility_hash
        self.failure_policy = failure_policy
        self.quarantine_seconds = quarantine_seconds
        self.receiving: dict[str, Receiving] = {}
        self.quarantined: list[Quarantine] = []
        self._quarantine_ids = 0
        self._on_landed: Callable[[], None] | None = None

    def on_landed(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the transfer's thread; it replaces any earlier one) whenever a
        receive lands or fails: the engine then has a request to step or an output to
        deliver, which a stepping loop asleep while idle would otherwise find only when it
        next wakes (up to 100 ms later: 1.0 ms a token at 1P1D with the tiny model)."""
        self._on_landed = callback

    def _landed(self) -> None:
        if self._on_landed is not None:
            self._on_landed()

    @property
    def has_pending(self) -> bool:
        """Transfers still landing, or destination pages still quarantined."""
        return bool(self.receiving or self.quarantined)

    # ---- the receiver's calls -------------------------------------------------------------

    def prepare_receive(self, message: TransferRequest) -> ReceivePlan:
        """Validate a transfer and reserve its destination. Raises TransferRejected (and holds
        nothing) when it cannot be accepted."""
        self.engine.raise_if_dead()
        plan = self._prepare(message)
        self.engine.requests[message.request_id] = self.receiving[message.request_id].request
        # The reservation may have evicted cached blocks whose offload is still only decided:
        # it must happen before the transfer writes the pages.
        self.engine.apply_decided_ops()
        return plan

    def complete_receive(self, request_id: str) -> None:
        """The transfer landed: the request decodes from here; the choices its prefill engine
        drew fork from it now (their first outputs go out with the next step)."""
        receiving = self.receiving.pop(request_id, None)
        if receiving is None:
            raise TransferRejected(
                "unknown_request", f"no transfer in progress for request {request_id!r}"
            )
        request = receiving.request
        for choice in self.scheduler.finish_receiving(request):
            self.engine.emit(choice)
        if request.is_finished:  # its first token ended it (decided here for n > 1)
            self.engine.emit(request)
        self.engine.apply_decided_ops()  # the received prompt's commit (its snapshot), forks
        self._landed()

    def fail_receive(
        self, request_id: str, reason: str, *, writer_done: bool
    ) -> RequestOutput | None:
        """A transfer into this engine failed: recompute it here, or end it with an error
        (returned, and delivered by the next step) per `transfer_failure_policy`."""
        request = self._fail(request_id, reason, writer_done=writer_done)
        self._landed()  # recomputed here, or an output to deliver
        if request is None or not request.is_finished:
            return None
        return self.engine.emit(request)

    def recover_lost_transfer(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        reason: str,
        cache_salt: str | None = None,
        stable_prompt_len: int | None = None,
        system_prompt_len: int | None = None,
    ) -> RequestOutput | None:
        """The transfer of `request_id` failed before this engine admitted it (the prefill
        side saw the failure, or the prefill engine died). The same policy as a receive that
        fails here decides (`_settle`): recompute the request here (same id and seed: same
        tokens), or end it with an error (delivered by the next step). Nothing is recomputed
        if the request reached this engine (the prefill engine died after its transfer
        landed): its own failure handling, or its decoding, has it, and its output so far is
        returned, so the caller can be given what it missed."""
        engine = self.engine
        if request_id in engine.requests:
            return engine.requests[request_id].to_output()
        engine.add_request(
            prompt,
            params,
            request_id=request_id,
            cache_salt=cache_salt,
            stable_prompt_len=stable_prompt_len,
            system_prompt_len=system_prompt_len,
        )
        request = engine.requests[request_id]
        self.scheduler.waiting.remove(request)  # _settle decides where it goes
        self._settle(request, reason)
        if request.is_finished:
            engine.emit(request)
        return None

    # ---- the engine's calls ---------------------------------------------------------------

    def abort(self, request_id: str, reason: str) -> None:
        """Give up a receive still in progress (the request was aborted, or the engine
        stopped): its pages wait in quarantine for a write that may still land."""
        self._fail(request_id, reason, writer_done=False)

    def sweep(self, now: float | None = None) -> None:
        """Free quarantined pages whose writers can no longer be active."""
        now = time.monotonic() if now is None else now
        keep = []
        for quarantine in self.quarantined:
            if quarantine.release_at <= now:
                self.cache.free_owner(quarantine.owner)
            else:
                keep.append(quarantine)
        self.quarantined = keep

    # ---- inside -----------------------------------------------------------------------------

    def _prepare(self, message: TransferRequest) -> ReceivePlan:
        request_id = message.request_id
        if request_id in self.engine.requests or request_id in self.receiving:
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
        lists = (
            sampling.stop_token_ids,
            sampling.choice_seeds,
            sampling.fork_token_ids,
            sampling.draft_token_ids,
        )
        if not all(isinstance(v, list) for v in (*lists, sampling.first_logprobs)):
            raise TransferRejected(
                "invalid_request",
                f"request {request_id}: stop_token_ids, choice_seeds, fork_token_ids, "
                "draft_token_ids and first_logprobs must be lists",
            )
        bad = next(
            (
                t
                for t in (
                    *prompt,
                    message.first_token,
                    *sampling.fork_token_ids,
                    *sampling.draft_token_ids,
                )
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
            grammar = self.engine.grammar(params)
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
        if sampling.draft_token_ids:
            hold_drafts(request, list(sampling.draft_token_ids))
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

    def _fail(self, request_id: str, reason: str, *, writer_done: bool) -> Request | None:
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
        self._settle(receiving.request, reason)
        return receiving.request

    def _settle(self, request: Request, reason: str) -> None:
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
