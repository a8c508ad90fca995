"""EngineHost: one engine with its stepping thread, transfer endpoint and request streams.

A plain class (tested without Ray); `cluster/control/actors.py` wraps it in a Ray actor. Threads:

    stepping thread   builds the engine, then engine.step() under the lock, turns outputs
                      into TokenEvents for the request streams, hands cache events to the
                      event sink, and prefilled requests to the senders of their decode peer
    sender threads    (prefill) `transfer_links_per_peer` per decode peer:
                      TransferSender.send, blocking
    receiver threads  (decode) TransferReceiver, one per link: lands transfers, under the
                      same lock, each once its request is expected here
    event loop        the caller's asyncio loop: the request coroutines below

(The senders, the receiver and the shard links are `cluster/engine_host/transfer_links.py`'s.)

Roles: `prefill` computes a prompt and its first token and ships the request to the decode
engine the caller named (`prefill`); `decode` opens the stream of a request it is about to
receive (`expect`), streams it (`follow`), recovers it after a failed transfer (`recover`),
or runs a whole request itself (`generate`: conditional disaggregation); `colocated` runs
everything. cluster/orchestrator.py puts these steps together for one request. `submit`,
`attach` and `submit_prefill` are `generate`, `follow` and `prefill` for a caller that takes
the events itself (the engine actor's per-subscriber outbox, cluster/transport/feed_server.py): a
step's events reach it at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from hybridserve.cluster.engine_host.cache_events import CacheEventFanout
from hybridserve.cluster.engine_host.request_stream import (
    RequestStream,
    TokenSink,
    dispatch,
    output_slice,
)
from hybridserve.cluster.engine_host.transfer_links import TransferLinks
from hybridserve.cluster.messages import GenerateRequest, PrefillResult, TokenEvent
from hybridserve.cluster.metrics import HistogramCounts
from hybridserve.kernels.cpu import threads
from hybridserve.transceiver.endpoint import SendOutcome
from hybridserve.transceiver.shards import RankShardsPort
from hybridserve.workers import Engine, EngineConfig, RequestOutput
from hybridserve.workers.disaggregation.prefill_port import Handoff
from hybridserve.workers.speculative.stats import SpeculationStats

logger = logging.getLogger(__name__)

# Output tokens of a disaggregated request that the prefill side delivers (the first; an
# expected stream on the decode side starts after them).
PREFILL_TOKENS = 1

# How long a transfer that arrives ahead of its request's expect waits for it before it is
# refused (expect goes out with the prefill, and lands first unless the event loop stalls).
EXPECT_WAIT_S = 2.0
# Streams closed lately, for a transfer that arrives after its request went (not to wait).
NUM_CLOSED_REMEMBERED = 4096
IDLE_WAIT_SECONDS = 0.005
AUDIT_INTERVAL_SECONDS = 30.0


class EngineUnavailable(RuntimeError):
    """The engine is shutting down or stopped: the request was not taken."""


class EngineHost:
    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        *,
        transfer_timeout: float = 30.0,
        transfer_deadline: float = 60.0,
        transfer_host: str = "127.0.0.1",
        rank_shards: Callable[[Engine], list[RankShardsPort]] | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`rank_shards`: the shard links of the engine's other ranks (a tensor-parallel
        engine's rank actors), for transfers with engines of other TP layouts;
        `stream_interval`: tokens per event (`_deliver`), validated by the ServiceConfig."""
        self.name = name
        self.role = engine_config.role
        self.stream_interval = stream_interval
        self.lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._expected = threading.Condition()  # a stream opened by expect, or closed
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.cache_events = CacheEventFanout(name, self.lock)
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._started = threading.Event()  # __init__ is done: the loop may step
        # The stepping loop's heartbeat: the time it last came round (health() reads it).
        self.last_beat = time.monotonic()
        self.integrity_failures = 0  # idle-time recounts that found the pools inconsistent
        # Sends of this (prefill) engine, first byte to ack; observed on the links' thread.
        self.transfer_times = HistogramCounts()
        self._times_lock = threading.Lock()
        self.cpu_threads: int | None = None  # the stepping thread's OpenMP threads
        # Core bindings for the stepping thread to make before its next step (`bind_cores`).
        self._bindings: collections.deque[tuple[list[int], concurrent.futures.Future[bool]]] = (
            collections.deque()
        )
        self._last_audit = time.monotonic()
        # The engine is built on the thread that steps it. Each thread that runs a torch
        # parallel region gets an OpenMP team of its own, and once a process has more
        # OpenMP threads than CPUs, libgomp has idle team members sleep after 100 spins, not
        # 300000: every parallel region waits for a wake-up. Building the model here and
        # stepping it there gave two teams and a 1.6x slower decode step on 2 cores.
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine_config, built), name=f"{name}-step", daemon=True
        )
        self._thread.start()
        self.engine = built.result()
        try:
            self.engine.subscribe(self.cache_events)
            if self.engine.decode_port is not None:
                # A landed transfer is work: the stepping loop must not sleep through it.
                self.engine.decode_port.on_landed(self._wake.set)
            self.links = TransferLinks(
                name,
                self.engine,
                engine_config,
                self.lock,
                host=transfer_host,
                timeout=transfer_timeout,
                deadline=transfer_deadline,
                rank_shards=rank_shards,
                expected=self._wait_expected,
            )
        except BaseException:
            self._stop.set()
            self._started.set()
            self.engine.shutdown()
            raise
        self._started.set()
        logger.info("engine host %s (%s) ready", name, self.role)

    # ---- facts ----------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        """Where prefill engines send transfers (decode role)."""
        return self.links.address

    def describe(self) -> dict[str, Any]:
        config = self.engine.model_config
        return {
            "name": self.name,
            "role": self.role,
            "address": list(self.address) if self.address else None,
            "vocab_size": config.vocab_size,
            "eos_token_ids": sorted(self.engine.eos_token_ids),
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.config.block_size,
            "partial_reuse": self.engine.config.enable_partial_reuse,
            "cpu_threads": self.cpu_threads,
        }

    def health(self, stall_timeout_s: float | None = None) -> None:
        """Raises EngineUnavailable once the engine has stopped (a rank died or hung) or, with
        `stall_timeout_s`, when its stepping loop has not come round for that long (wedged:
        a step that never returns, a lock never released). Answers without the engine lock,
        so a wedged engine cannot hold up its own health check."""
        reason = self.engine.dead
        if reason is not None:
            raise EngineUnavailable(f"engine {self.name} stopped: {reason}")
        silent = time.monotonic() - self.last_beat
        if stall_timeout_s is not None and silent > stall_timeout_s:
            raise EngineUnavailable(
                f"engine {self.name} is wedged: its stepping loop has not come round for "
                f"{silent:.1f} s (engine_stall_timeout_s={stall_timeout_s:g})"
            )

    def bind_cores(self, cores: list[int]) -> concurrent.futures.Future[bool]:
        """Confine the stepping thread and its OpenMP team, the engine's compute, to `cores`
        (cluster/engine_host/cpu_binding.py); the event loop, the transfer links and Ray's threads
        stay free to run on any core. Done by the stepping thread (the team is its own) before its
        next step; whether it could."""
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._bindings.append((cores, done))
        self._wake.set()
        return done

    def team_cores(self) -> list[int]:
        """The cores the stepping thread may run on."""
        return sorted(os.sched_getaffinity(self._thread.native_id))

    def stats(self) -> dict[str, Any]:
        """Load and cache figures for routing and /metrics."""
        with self.lock:
            cache = self.engine.cache
            scheduler = self.engine.scheduler
            prefill_port = self.engine.prefill_port
            num_blocks = self.engine.num_kv_blocks
            used = num_blocks - cache.num_free_blocks
            speculator = scheduler.speculator
            speculation = speculator.stats if speculator is not None else SpeculationStats()
            return {
                "num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage_perc": used / num_blocks if num_blocks else 0.0,
                "num_preemptions": scheduler.num_preemptions,
                "num_prompt_tokens_computed": scheduler.num_prompt_tokens_computed,
                "num_forks": scheduler.num_forks,
                "num_requests_aborted": self.engine.num_requests_aborted,
                "snapshot_hits": cache.stats.hits,
                "snapshot_misses": cache.stats.misses,
                "reused_tokens": cache.stats.reused_tokens,
                "transfer_bytes": self.links.bytes_sent,
                "transfer_failures": self.links.failures(),
                "transfer_links_refused": self.links.refused_links,
                "num_free_blocks": cache.num_free_blocks,
                "num_free_slots": cache.num_free_slots,
                # Held by requests, hand-offs, receives or quarantine (blocks cached in the
                # prefix tree and free to reuse are not): all 0 on an idle engine.
                "kv_blocks_in_use": used,
                "state_slots_in_use": cache.recurrent.num_live_slots - cache.num_free_slots,
                "transfers_in_flight": self.links.num_sending + self.links.num_receiving,
                "handoffs_held": len(prefill_port.pending) if prefill_port is not None else 0,
                "integrity_failures": self.integrity_failures,
                "spec_decode_num_drafts": speculation.num_drafts,
                "spec_decode_num_draft_tokens": speculation.num_draft_tokens,
                "spec_decode_num_accepted_tokens": speculation.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(speculation.accepted_per_position),
                "transfer_time_seconds": self._transfer_times(),
            }

    def _transfer_times(self) -> dict[str, Any]:
        with self._times_lock:
            return self.transfer_times.model_dump()

    def check_integrity(self) -> dict[str, Any]:
        """Recount the pools; the free counts once no request runs (for tests and probes)."""
        with self.lock:
            self.engine.check_integrity()
            cache = self.engine.cache
            return {
                "num_free_blocks": cache.num_free_blocks,
                "num_blocks": self.engine.num_kv_blocks,
                "num_free_slots": cache.num_free_slots,
                "num_live_slots": cache.recurrent.num_live_slots,
                "busy": self._busy(),
            }

    # ---- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Run a whole request here (colocated, or decode prefilling a short suffix)."""
        stream = self._open(request.request_id, request.params.n)
        try:
            self._add(request)
            async for event in self._drain(stream):
                yield event
        finally:
            self._close(request.request_id)

    async def expect(self, request_id: str, num_choices: int = 1) -> None:
        """Decode role: open the stream of a request a prefill engine sends here (to
        `address`). Its first token is delivered by the prefill side (as soon as that engine
        has it), so this stream starts after it; the first tokens of its other choices
        (n > 1) come from here, where they fork."""
        assert self.address is not None, "expect needs role=decode"
        with self._expected:
            self._open(request_id, num_choices).num_sent[0] = PREFILL_TOKENS
            self._expected.notify_all()

    def _wait_expected(self, request_id: str) -> bool:
        """On a transfer link: whether `request_id` is expected here, waiting up to
        EXPECT_WAIT_S for its expect (the caller sends it and the prefill at once), unless
        its stream has come and gone (its caller left)."""
        with self._expected:
            self._expected.wait_for(
                lambda: request_id in self._streams or request_id in self._closed, EXPECT_WAIT_S
            )
            return request_id in self._streams

    def _stream_closed(self, request_id: str) -> None:
        if self.role != "decode":
            return  # no transfer waits for a stream here
        with self._expected:
            self._closed[request_id] = None
            if len(self._closed) > NUM_CLOSED_REMEMBERED:
                self._closed.popitem(last=False)
            self._expected.notify_all()

    async def recover(self, request: GenerateRequest, delivered: int, reason: str) -> None:
        """Decode role: the transfer of an expected request failed on the prefill side (or
        the prefill engine died). The engine's failure policy decides: recompute here, or
        end the request with an error. `delivered`: output tokens the caller already has."""
        stream = self._expected_stream(request.request_id)
        self.links.count_failure("transfer_failed")
        with self.lock:
            # Output already delivered here means the transfer landed (the request may even
            # have finished and left the engine): nothing to recompute.
            assert self.engine.decode_port is not None, "only a decode engine recovers"
            held = stream.first_output or self.engine.decode_port.recover_lost_transfer(
                request.prompt_token_ids,
                request.params,
                request_id=request.request_id,
                reason=reason,
                cache_salt=request.cache_salt,
                stable_prompt_len=request.stable_prompt_len,
                system_prompt_len=request.system_prompt_len,
            )
            if held is None:  # recomputed from the prompt: deliver from the caller's position
                stream.num_sent[0] = delivered
            else:
                self._resend_missed(stream, held, delivered)
        self._wake.set()

    def _resend_missed(self, stream: RequestStream, held: RequestOutput, delivered: int) -> None:
        """The transfer landed here, but the caller did not get the first token from the
        prefill side (that engine died before the token reached the caller). This stream
        starts after it (`expect`), and later tokens may be queued already:

            output tokens | 0 .. delivered | delivered .. FIRST  | FIRST ..
                          | caller has     | missed: sent now,   | this stream's: queued
                          |                | ahead of the queue  | or still to come

        If the engine has no output yet (its receive is still pending), the stream simply
        starts at `delivered`."""
        missed, logprobs = output_slice(held, delivered, PREFILL_TOKENS)
        if not missed:
            stream.num_sent[0] = min(stream.num_sent.get(0, 0), delivered)
            return
        event = TokenEvent(
            held.request_id,
            delivered,
            missed,
            num_cached_tokens=held.num_cached_tokens,
            logprobs=logprobs,
        )
        stream.put_first(event)

    async def follow(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """Decode role: the rest of an expected request's tokens, as the engine produces
        them (queued from `expect` on: none is missed)."""
        stream = self._expected_stream(request_id)
        try:
            async for event in self._drain(stream):
                yield event
        finally:
            self._close(request_id)

    async def release(self, request_id: str) -> None:
        """The caller will not follow an expected request (it ended with its first token, or
        its prefill failed outright)."""
        self._close(request_id)

    def submit(self, request: GenerateRequest, sink: TokenSink) -> None:
        """`generate` for a caller that takes the events itself: they go to `sink` (on this
        loop, all of a step's in one callback) until the caller closes the stream
        (`close_stream`), which also aborts the request if it has not ended."""
        self._open(request.request_id, request.params.n).sink = sink
        try:
            self._add(request)
        except BaseException:
            self._close(request.request_id)
            raise

    def attach(self, request_id: str, sink: TokenSink) -> None:
        """`follow` for a caller that takes the events itself: what is queued already goes
        to `sink` first."""
        stream = self._expected_stream(request_id)
        stream.sink = sink
        while not stream.queue.empty():
            sink(stream.queue.get_nowait())

    def close_stream(self, request_id: str) -> None:
        """The caller of `submit` or `attach` is done with the request: aborted here unless
        it has ended."""
        self._close(request_id)

    def _expected_stream(self, request_id: str) -> RequestStream:
        stream = self._streams.get(request_id)
        if stream is None:
            raise ValueError(f"request {request_id!r} is not expected on {self.name}")
        return stream

    async def prefill(
        self, request: GenerateRequest, decode_address: tuple[str, int]
    ) -> AsyncGenerator[TokenEvent | PrefillResult, None]:
        """Prefill role: compute the prompt and first token, and ship the request to
        `decode_address`. Yields the first token's event as soon as it exists (the transfer
        is under way then), and last the PrefillResult: how the transfer went."""
        stream = self._open(request.request_id)
        try:
            try:
                done = self._start_prefill(stream, request, decode_address)
            except ValueError as exc:
                yield PrefillResult(request.request_id, "error", detail=str(exc))
                return
            yield await stream.queue.get()
            yield await done
        finally:
            self._close(request.request_id)  # also when closed early: aborts it here

    def submit_prefill(
        self, request: GenerateRequest, decode_address: tuple[str, int], sink: TokenSink
    ) -> asyncio.Future[PrefillResult]:
        """`prefill` for a caller that takes the first token's event itself (`sink`, on this
        loop): returns the PrefillResult's future. The caller closes the stream once it has
        the result (`close_stream`), which aborts the request if it is still running here.
        Raises ValueError for a request the engine refuses, EngineUnavailable when the engine
        is shutting down or stopped (nothing stays open)."""
        stream = self._open(request.request_id)
        stream.sink = sink
        try:
            return self._start_prefill(stream, request, decode_address)
        except BaseException:
            self._close(request.request_id)
            raise

    def _start_prefill(
        self, stream: RequestStream, request: GenerateRequest, decode_address: tuple[str, int]
    ) -> asyncio.Future[PrefillResult]:
        stream.decode_address = (str(decode_address[0]), int(decode_address[1]))
        stream.prefill_done = stream.loop.create_future()
        self._add(request)
        return stream.prefill_done

    def clear_cache(self) -> None:
        """Drop every cached block and snapshot and send the removal events now."""
        with self.lock:
            self.engine.clear_cache()
        self.cache_events.flush()

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is here; True if it was known."""
        return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        with self.lock:
            output = self.engine.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None and stream.prefill_done is None:
            # The stream goes with the request, also when nobody follows it (a decode engine
            # whose transfer has not landed, or whose follower was cancelled before it
            # started); a follower still gets the abort. (prefill() closes its own stream.)
            del self._streams[request_id]
            self._stream_closed(request_id)
            if not stream.ended:
                stream.end(request_id, "abort")
        elif output is not None and stream is not None:
            stream.end(request_id, "abort")
        self.cache_events.flush()
        return output is not None

    # ---- lifecycle ------------------------------------------------------------------------

    async def drain(self, timeout: float) -> int:
        """Stop taking requests; wait up to `timeout` for running ones, then end the rest
        with an error event. Returns how many were cut off."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self._busy():
                    break
            await asyncio.sleep(0.05)
        return self._fail_all(f"engine {self.name} shut down before the request finished")

    def shutdown(self) -> None:
        self._accepting = False
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.links.close()
        self.engine.shutdown()  # a tensor-parallel engine's other ranks

    # ---- internals ------------------------------------------------------------------------

    def _open(self, request_id: str, num_choices: int = 1) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use on {self.name}")
        stream = RequestStream(asyncio.get_running_loop(), num_choices)
        self._streams[request_id] = stream
        return stream

    def _close(self, request_id: str) -> None:
        """The caller is done (finished, cancelled or failed): nothing may stay behind."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._stream_closed(request_id)
        if not stream.ended:
            self._abort(request_id)
        stream.settle(PrefillResult(request_id, "error", detail="the request was closed"))

    def _busy(self) -> bool:
        """Requests or transfers in flight (call under the lock)."""
        return self.engine.has_unfinished_requests() or self.engine.has_pending_transfers()

    def _add(self, request: GenerateRequest) -> None:
        if not self._accepting:
            raise EngineUnavailable(f"engine {self.name} is shutting down")
        self.health()
        with self.lock:
            self.engine.add_request(
                request.prompt_token_ids,
                request.params,
                request_id=request.request_id,
                cache_salt=request.cache_salt,
                stable_prompt_len=request.stable_prompt_len,
                system_prompt_len=request.system_prompt_len,
            )
        self._wake.set()

    async def _drain(self, stream: RequestStream) -> AsyncIterator[TokenEvent]:
        while True:
            event = await stream.queue.get()
            yield event
            if event.finished:
                return

    def _run(self, engine_config: EngineConfig, built: concurrent.futures.Future[Engine]) -> None:
        try:
            threads.follow_torch_threads()
            engine = Engine(engine_config)
            # A tensor-parallel engine on the CPU has set torch's count for its ranks.
            self.cpu_threads = threads.follow_torch_threads()
        except BaseException as exc:  # the constructor re-raises it
            built.set_exception(exc)
            return
        built.set_result(engine)
        self._started.wait()
        while not self._stop.is_set():
            self.last_beat = time.monotonic()
            while self._bindings:
                cores, done = self._bindings.popleft()
                # A binding its caller gave up on (bind_cpus' timeout, which gave the cores
                # back) is not made.
                if done.set_running_or_notify_cancel():
                    done.set_result(threads.bind_team(cores))
            try:
                with self.lock:
                    outputs = self.engine.step()
                    port = self.engine.prefill_port
                    handoffs = port.take_handoffs() if port is not None else []
                    busy = self.engine.has_unfinished_requests()
            except Exception:
                logger.exception("engine %s: step failed; failing its running requests", self.name)
                self._fail_all("the engine step failed; see the engine log")
                continue
            dispatch([d for output in outputs if (d := self._deliver(output)) is not None])
            for handoff in handoffs:
                self._ship(handoff)
            self.cache_events.flush()
            if not busy:
                self._audit()
                self._wake.wait(IDLE_WAIT_SECONDS * 20)
                self._wake.clear()

    def _audit(self) -> None:
        """Now and then while idle, recount the pools (cheap with nothing running): a
        failure is counted (`integrity_failures`) and logged with the requests involved."""
        if time.monotonic() - self._last_audit < AUDIT_INTERVAL_SECONDS:
            return
        self._last_audit = time.monotonic()
        with self.lock:
            try:
                self.engine.cache.check_integrity()
            except (AssertionError, RuntimeError) as exc:
                self.integrity_failures += 1
                scheduler = self.engine.scheduler
                held = [r.request_id for r in (*scheduler.running, *scheduler.waiting)]
                held += list(scheduler.transferring)
                logger.error(
                    "engine %s: cache integrity check failed (%s); requests held: %s",
                    self.name,
                    exc,
                    held or "none",
                )

    def _deliver(self, output: RequestOutput) -> tuple[RequestStream, TokenEvent] | None:
        """The new tokens of one choice, as an event for its request's stream
        (`RequestStream.next_event`); None when there is no stream or nothing to send yet."""
        request_id = output.parent_request_id or output.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            # Its caller went away (the request was aborted by _close), or nobody expects it
            # any more (a transfer or recompute that landed after the abort): stop it.
            if not output.finished:
                with self.lock:
                    self.engine.abort(request_id)
            return None
        event = stream.next_event(request_id, output, self.stream_interval)
        return None if event is None else (stream, event)

    def _ship(self, handoff: Handoff) -> None:
        request_id = handoff.request.request_id
        stream = self._streams.get(request_id)
        if stream is None or stream.decode_address is None:
            assert self.engine.prefill_port is not None
            with self.lock:
                self.engine.prefill_port.release_handoff(request_id, "no destination")
            return
        start = time.monotonic()
        self.links.send(
            request_id,
            handoff.message,
            stream.decode_address,
            lambda outcome: self._shipped(stream, outcome, time.monotonic() - start),
        )

    def _shipped(self, stream: RequestStream, outcome: SendOutcome, seconds: float) -> None:
        if outcome.ok:
            with self._times_lock:
                self.transfer_times.observe(seconds)
        status = "handed_off" if outcome.ok else "transfer_failed"
        stream.ended = True
        result = PrefillResult(
            outcome.request_id,
            status,
            detail=outcome.detail,
            blocks_sent=outcome.blocks_sent,
            blocks_held=outcome.blocks_held,
            bytes_sent=outcome.bytes_sent,
        )
        # The caller's loop may be gone (its prefill was closed and it shut down).
        if stream.prefill_done is not None and not stream.loop.is_closed():
            stream.loop.call_soon_threadsafe(stream.settle, result)

    def _fail_all(self, reason: str) -> int:
        """End every open request with an error event; returns how many."""
        streams = list(self._streams.items())
        for request_id, stream in streams:
            with self.lock:
                self.engine.abort(request_id)
            stream.end(request_id, "error", reason)
        return len(streams)
