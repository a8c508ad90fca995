"""An engine host's transfer links: its backend, its ranks' shard links, the receiver a
decode engine listens on, and `transfer_links_per_peer` senders (a link and a thread each)
per decode peer a prefill engine ships to.

    prefill:  Handoff ──send(address)──▶ PeerSenders[address]: an idle TransferSender ──▶
    decode:   TransferReceiver (a thread per link) lands each transfer in the engine, under
              the engine's lock

A link carries one transfer at a time, and a transfer waits for the decode engine's steps: it
reserves the pages and admits the request between two of them, and the prefill engine frees
the hand-off's pages between two of its own once the ack is in. A prefill step hands off a
batch of requests at once; on one link their waits added up transfer after transfer (on 2
cores at 32 streams, a hand-off waited 1.6 s in the median for the link), on several they
overlap.

Every rank of a disaggregated engine moves its own shards of each transfer (shard links:
rank 0's here, the other ranks' from `rank_shards`). Links check the deployment's secret.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hybridserve.transceiver.base import Pools
from hybridserve.transceiver.endpoint import SendOutcome, TransferReceiver, TransferSender
from hybridserve.transceiver.protocol import TransferRequest
from hybridserve.transceiver.registry import create_backend
from hybridserve.transceiver.shards import (
    EngineShards,
    RankShards,
    RankShardsPort,
    ShardReceiver,
    ShardSender,
)
from hybridserve.workers import Engine, EngineConfig

logger = logging.getLogger(__name__)

Address = tuple[str, int]


class TransferLinks:
    def __init__(
        self,
        name: str,
        engine: Engine,
        config: EngineConfig,
        lock: threading.Lock,
        *,
        host: str,
        timeout: float,
        deadline: float,
        rank_shards: Callable[[Engine], list[RankShardsPort]] | None = None,
        expected: Callable[[str], bool] | None = None,
    ) -> None:
        """`expected(request_id)`: whether the decode engine expects the request, waiting
        for it a while; a transfer it does not expect is refused."""
        self.name = name
        self.engine = engine
        self.role = config.role
        self.lock = lock
        secret = config.transfer_secret
        if self.role != "colocated" and secret is None:
            raise ValueError(
                f"engine {name}: a {self.role} engine needs transfer_secret, the deployment's "
                "secret its transfer links check (the service's Coordinator sets it)"
            )
        self._secret = secret or ""
        self._timeout, self._deadline = timeout, deadline
        self._backend = create_backend(
            config.transfer_backend, Pools.of(engine.caches), config.transfer_streams
        )
        self._links_per_peer = config.transfer_links_per_peer
        self._senders: dict[Address, PeerSenders] = {}
        self.num_sending = 0
        self.bytes_sent = 0
        self._failures: dict[str, int] = {}  # failed transfers by reason
        self._counts_lock = threading.Lock()  # the counts change on every sender thread
        self.receiver: TransferReceiver | None = None
        self.shards: EngineShards | None = None
        self._local_shards: RankShards | None = None
        if self.role == "colocated":
            return
        # Rank 0's own shard links, then the other ranks'.
        link = {"secret": self._secret, "timeout": timeout, "deadline": deadline}
        self._local_shards = RankShards(
            receiver=ShardReceiver(engine.layout, self._backend, host=host, **link)
            if self.role == "decode"
            else None,
            sender=ShardSender(engine.layout, self._backend, **link)
            if self.role == "prefill"
            else None,
        )
        others = rank_shards(engine) if rank_shards is not None else []
        self.shards = EngineShards([self._local_shards, *others])
        if self.role == "decode":
            # NOTE: a receive that fails under policy `fail` ends the request inside the
            # engine, which reports it on its next step: it reaches the stream from there.
            assert engine.decode_port is not None
            self.receiver = TransferReceiver(
                engine.decode_port,
                engine.layout,
                self._backend,
                secret=self._secret,
                lock=lock,
                host=host,
                timeout=timeout,
                deadline=deadline,
                shards=self.shards,
                admit=expected,
            )

    @property
    def address(self) -> Address | None:
        """Where prefill engines send to (decode role)."""
        return self.receiver.address if self.receiver is not None else None

    @property
    def refused_links(self) -> dict[str, int]:
        return dict(self.receiver.refused_links) if self.receiver is not None else {}

    @property
    def num_receiving(self) -> int:
        port = self.engine.decode_port
        return len(port.receiving) if port is not None else 0

    def send(
        self,
        request_id: str,
        message: TransferRequest,
        address: Address,
        on_outcome: Callable[[SendOutcome], None],
    ) -> None:
        """Ship a hand-off to the decode engine at `address` on one of that peer's links;
        `on_outcome` gets the outcome on the link's thread (a send that raised counts as
        failed, its hand-off released, so the decode side recovers and nothing stays held)."""
        senders = self._peer(address)
        with self._counts_lock:
            self.num_sending += 1

        def done(future: Future[SendOutcome]) -> None:
            outcome = self._outcome(request_id, future)
            with self._counts_lock:
                self.num_sending -= 1
                self.bytes_sent += outcome.bytes_sent
            if not outcome.ok:
                self.count_failure(outcome.status)  # TransferSender has logged it
            on_outcome(outcome)

        senders.submit(request_id, message).add_done_callback(done)

    def count_failure(self, reason: str) -> None:
        """A transfer failed: sent from here, or (decode) lost on the prefill side."""
        with self._counts_lock:
            self._failures[reason] = self._failures.get(reason, 0) + 1

    def failures(self) -> dict[str, int]:
        """Failed transfers by reason, since start."""
        with self._counts_lock:
            return dict(self._failures)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        for senders in self._senders.values():
            senders.close()
        if self._local_shards is not None:
            self._local_shards.close()
        self._backend.close()

    def _outcome(self, request_id: str, future: Future[SendOutcome]) -> SendOutcome:
        exc = future.exception()
        if exc is None:
            return future.result()
        logger.error("request %s: the transfer send raised", request_id, exc_info=exc)
        with self.lock:
            assert self.engine.prefill_port is not None
            self.engine.prefill_port.release_handoff(request_id, f"send raised: {exc!r}")
        return SendOutcome(request_id, "failed", f"the send raised {exc!r}")

    def _peer(self, address: Address) -> PeerSenders:
        if address not in self._senders:
            port = self.engine.prefill_port
            assert port is not None, "only a prefill engine sends"
            senders = [
                TransferSender(
                    port,
                    self.engine.layout,
                    self._backend,
                    address,
                    secret=self._secret,
                    lock=self.lock,
                    timeout=self._timeout,
                    deadline=self._deadline,
                    shards=self.shards,
                )
                for _ in range(self._links_per_peer)
            ]
            host, port = address
            self._senders[address] = PeerSenders(senders, f"{self.name}-send-{host}:{port}")
        return self._senders[address]


class PeerSenders:
    """The senders to one decode peer, each on its own link (opened at its first send), and
    as many threads: a send takes the idle sender used last (links open only as concurrency
    asks for them). A failed send closes the idle links too: if the peer went away (a
    restarted decode engine at the same address), each would fail one transfer of its own."""

    def __init__(self, senders: list[TransferSender], thread_name: str) -> None:
        self._senders = senders
        self._idle: queue.LifoQueue[TransferSender] = queue.LifoQueue()
        for sender in reversed(senders):
            self._idle.put(sender)
        # As many threads as senders: a running send always finds one idle.
        self._threads = ThreadPoolExecutor(len(senders), thread_name_prefix=thread_name)

    def submit(self, request_id: str, message: TransferRequest) -> Future[SendOutcome]:
        return self._threads.submit(self._send, request_id, message)

    def _send(self, request_id: str, message: TransferRequest) -> SendOutcome:
        sender = self._idle.get()  # never waits long: a thread per sender
        failed = True
        try:
            outcome = sender.send(request_id, message)
            failed = outcome.status == "failed"
            return outcome
        finally:
            self._idle.put(sender)
            if failed:
                self._close_idle_links()

    def _close_idle_links(self) -> None:
        """Close the links no send uses now (each reopens at its next send)."""
        idle = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:  # the rest are sending (another thread may take one meanwhile)
                break
        for sender in idle:
            sender.close_link()
        for sender in reversed(idle):
            self._idle.put(sender)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for sender in self._senders:
            sender.close_link()
