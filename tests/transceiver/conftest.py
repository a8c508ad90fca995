"""Fixtures of the transceiver tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hybridserve.transceiver.base import Pools, TransferBackend
from hybridserve.transceiver.channel import Channel
from hybridserve.transceiver.endpoint import TransferReceiver, TransferSender
from hybridserve.transceiver.registry import create_backend
from hybridserve.workers import Engine, EngineConfig
from tests.helpers import TRANSFER_SECRET, make_hf_model
from tests.transceiver.link import (
    ENGINE_ARGS,
    LEASE,
    TIMEOUT,
    Link,
    colocated_tokens,
)


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    """(client, server) channels over one loopback TCP connection, 5 s default timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    client = Channel.connect(server.getsockname()[:2], timeout=5.0)
    accepted, _ = server.accept()
    server.close()
    peer = Channel(accepted, timeout=5.0)
    yield client, peer
    client.close()
    peer.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("bamba")
    make_hf_model("bamba").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str, list[int]]:
    """The oracle: each request's tokens from one colocated engine."""
    return colocated_tokens(checkpoint)


def _is_clean(engine: Engine) -> bool:
    cache = engine.cache
    return (
        not engine.has_unfinished_requests()
        and not engine.has_pending_transfers()
        and cache.num_free_blocks == engine.num_kv_blocks
        and cache.num_free_slots == cache.recurrent.num_live_slots
    )


@pytest.fixture(scope="module")
def engine_pool(checkpoint) -> Callable[..., Engine]:
    """Engines are shared by the tests of this module (loading one costs more than most
    scenarios): every scenario leaves them at baseline, which it asserts; one that a failed
    test left dirty is replaced, so that one failure does not cascade."""
    engines: dict[tuple[str, str], Engine] = {}

    def get(role: str, variant: str = "", **args: Any) -> Engine:
        key = (role, variant)
        if key not in engines or not _is_clean(engines[key]):
            config = ENGINE_ARGS | {"model": checkpoint, "role": role} | args
            engines[key] = Engine(EngineConfig(**config))
        return engines[key]

    return get


@pytest.fixture
def make_link(engine_pool) -> Iterator[Callable[..., Link]]:
    links: list[Link] = []

    def build(
        *,
        policy: str = "recompute",
        backend: str = "tcp",
        wrap_sender: Callable[[TransferBackend], TransferBackend] = lambda b: b,
        wrap_receiver: Callable[[TransferBackend], TransferBackend] = lambda b: b,
        sender_timeout: float = TIMEOUT,
        receiver_timeout: float = TIMEOUT,
        sender_deadline: float = 60.0,
        receiver_deadline: float = 60.0,
        receiver_secret: str = TRANSFER_SECRET,
        decode_args: dict[str, Any] | None = None,
        prefill_args: dict[str, Any] | None = None,
    ) -> Link:
        prefill = engine_pool(
            "prefill", f"{prefill_args}", transfer_lease_seconds=LEASE, **prefill_args or {}
        )
        decode = engine_pool(
            "decode", f"{policy}{decode_args}", transfer_failure_policy=policy, **decode_args or {}
        )
        # NOTE: a failed NIXL receive keeps its pages 5 s (a late write may still land);
        # shortened so that the baseline check does not wait that long.
        decode.decode_port.quarantine_seconds = LEASE
        prefill_lock, decode_lock = threading.Lock(), threading.Lock()
        receiver = TransferReceiver(
            decode.decode_port,
            decode.layout,
            wrap_receiver(
                create_backend(backend, Pools.of(decode.caches), decode.config.transfer_streams)
            ),
            secret=receiver_secret,
            lock=decode_lock,
            host="127.0.0.1",
            timeout=receiver_timeout,
            deadline=receiver_deadline,
        )
        sender = TransferSender(
            prefill.prefill_port,
            prefill.layout,
            wrap_sender(
                create_backend(backend, Pools.of(prefill.caches), prefill.config.transfer_streams)
            ),
            receiver.address,
            secret=TRANSFER_SECRET,
            lock=prefill_lock,
            timeout=sender_timeout,
            deadline=sender_deadline,
        )
        link = Link(prefill, decode, sender, receiver, prefill_lock, decode_lock)
        links.append(link)
        return link

    yield build
    for link in links:
        link.sender.close_link()
        link.receiver.close()
        link.sender.backend.close()
        link.receiver.backend.close()
