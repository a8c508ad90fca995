"""An engine worker's transfer links: its backend, its ranks' shard links, the receiver a
decode engine listens on, and one sender (with its own thread) per decode peer a prefill
engine ships to.

    prefill:  Handoff ──send(address)──▶ TransferSender[address] ──▶ decode's receiver
    decode:   TransferReceiver lands each transfer in the engine, under the engine's lock

Every rank of a disaggregated engine moves its own shards of each transfer (shard links:
rank 0's here, the other ranks' from `rank_shards`). Links check the deployment's secret.
"""

from __future__ import annotations

import logging
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
    ) -> None:
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
        self._senders: dict[Address, tuple[TransferSender, ThreadPoolExecutor]] = {}
        self.num_sending = 0
        self.bytes_sent = 0
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
            self.receiver = TransferReceiver(
                engine,
                engine.layout,
                self._backend,
                secret=self._secret,
                lock=lock,
                host=host,
                timeout=timeout,
                deadline=deadline,
                shards=self.shards,
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
        receives = self.engine.receives
        return len(receives.receiving) if receives is not None else 0

    def send(
        self,
        request_id: str,
        message: TransferRequest,
        address: Address,
        on_outcome: Callable[[SendOutcome], None],
    ) -> None:
        """Ship a hand-off to the decode engine at `address` on that peer's sender thread;
        `on_outcome` gets the outcome there (a send that raised counts as failed, its
        hand-off released, so the decode side recovers and nothing stays held)."""
        sender, executor = self._sender(address)
        self.num_sending += 1

        def done(future: Future[SendOutcome]) -> None:
            outcome = self._outcome(request_id, future)
            self.num_sending -= 1
            self.bytes_sent += outcome.bytes_sent
            on_outcome(outcome)

        executor.submit(sender.send, request_id, message).add_done_callback(done)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        for sender, executor in self._senders.values():
            executor.shutdown(wait=True)
            sender.close_link()
        if self._local_shards is not None:
            self._local_shards.close()
        self._backend.close()

    def _outcome(self, request_id: str, future: Future[SendOutcome]) -> SendOutcome:
        exc = future.exception()
        if exc is None:
            return future.result()
        logger.error("request %s: the transfer send raised", request_id, exc_info=exc)
        with self.lock:
            self.engine.release_handoff(request_id, f"send raised: {exc!r}")
        return SendOutcome(request_id, "failed", f"the send raised {exc!r}")

    def _sender(self, address: Address) -> tuple[TransferSender, ThreadPoolExecutor]:
        if address not in self._senders:
            sender = TransferSender(
                self.engine,
                self.engine.layout,
                self._backend,
                address,
                secret=self._secret,
                lock=self.lock,
                timeout=self._timeout,
                deadline=self._deadline,
                shards=self.shards,
            )
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-send")
            self._senders[address] = (sender, executor)
        return self._senders[address]
