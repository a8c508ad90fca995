"""NIXL backend: the sender WRITEs regions straight into the receiver's registered pools (UCX;
DRAM here, VRAM on GPUs) and tags the transfer with the request id as a notification.

Both sides register their KV and state pools once. The Hello carries the agent metadata,
per pool (base address, region bytes, stride, device), so a sender turns a receiver's block id
into an address without another round trip, and the sender's stream count.

Streams: a transfer of several regions is cut into up to `num_streams` parts, each posted and
driven by its own thread on its own UCX worker, so copies run in parallel (on host memory UCX
copies with one `process_vm_writev` per region on the posting thread: one stream used one core,
2 streams took bench/transfer.py from ~55% to ~75% of memcpy at 256 MiB). Each part notifies
under its own tag; the receiver cuts the same copy list the same way and waits for every tag
(matched exactly, in an inbox of this backend's own: NIXL's lookup helper matches substrings
and is not safe from several receiving threads).

    copies   [r0 r1 r2 r3 r4 r5 r6]             parts = split_parts(copies, 2)
    part 0   [r0 r1 r2]       -> "req#0/2"      thread 0, UCX worker 0
    part 1   [r3 r4 r5 r6]    -> "req#1/2"      thread 1, UCX worker 1
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

from hybridserve.transceiver.base import Pools, RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed

logger = logging.getLogger(__name__)

# Receives given up lately, whose parts are dropped if they still arrive (else they would wait
# in the inbox until the peer's last link closed, a long-lived peer gathering them).
NUM_ABANDONED_REMEMBERED = 4096


def split_parts(copies: list[RegionCopy], num_streams: int) -> list[list[RegionCopy]]:
    """Up to `num_streams` contiguous, non-empty runs of `copies`, sizes differing by <= 1
    (none for no copies)."""
    n = min(num_streams, len(copies))
    return [copies[i * len(copies) // n : (i + 1) * len(copies) // n] for i in range(n)]


def part_tag(request_id: str, part: int, num_parts: int) -> bytes:
    return f"{request_id}#{part}/{num_parts}".encode()


def _request_of(tag: bytes) -> bytes:
    """A part tag's request: what precedes its last "#" (a request id may hold one too)."""
    return tag[: tag.rfind(b"#")]


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(self, pools: Pools, num_streams: int = 1) -> None:
        super().__init__(pools)
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams}")
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise RuntimeError(
                "transfer backend 'nixl' needs the nixl package (pip install "
                "nixl); use transfer_backend='tcp' without it"
            ) from exc
        # NOTE: no progress thread. `send` polls check_xfer_state and `receive` polls
        # check_remote_xfer_done for the whole transfer, and those calls drive UCX progress.
        # The thread busy-polls (~0.6 of a core per agent, even idle): on 2 cores it cut DRAM
        # writes between two processes from ~3 to ~1 GB/s (bench/transfer.py).
        # Sync RW: transfers are posted and polled from several threads at once (the streams,
        # and the endpoint's per-peer senders), so the agent takes its lock shared on the data
        # path and exclusive for registration and peer changes. (The default without a listen
        # thread is no lock at all; STRICT would serialise the streams' copies.)
        self.agent = nixl_agent(
            f"hybridserve-{uuid.uuid4().hex[:12]}",
            nixl_agent_config(
                enable_prog_thread=False,
                backends=[],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            ),
        )
        # One UCX worker per stream: NIXL gives each posting thread its own worker.
        self.agent.create_backend("UCX", {"num_workers": str(num_streams)})
        self.num_streams = num_streams
        # Stream threads per peer: a slow or dead peer holds only its own (until its timeout).
        self._streams: dict[str, ThreadPoolExecutor] = {}
        self._inbox: dict[str, set[bytes]] = {}  # peer -> notifications not yet taken
        self._abandoned: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._inbox_lock = threading.Lock()
        tensors = list(pools.tensors.values())
        self.on_gpu = any(t.is_cuda for t in tensors)
        self.mem_type = "VRAM" if self.on_gpu else "DRAM"
        self._registered = self.agent.register_memory(tensors)
        self.layout = {kind: self._pool_layout(t) for kind, t in pools.tensors.items()}
        self.peers: dict[str, dict[str, Any]] = {}
        # Links open to each peer: a prefill engine keeps several to one decode engine
        # (transfer_links_per_peer), and the peer is forgotten when its last one closes.
        self._num_links: dict[str, int] = {}
        self._peers_lock = threading.Lock()

    @staticmethod
    def _pool_layout(pool: Any) -> list[int]:
        """[base address, bytes per region, stride between regions in bytes, device id]."""
        item = pool.element_size()
        return [
            pool.data_ptr(),
            pool[0].numel() * item,
            pool.stride(0) * item,
            pool.device.index or 0,
        ]

    def local_info(self) -> bytes:
        return msgpack.packb(
            {
                "metadata": self.agent.get_agent_metadata(),
                "mem_type": self.mem_type,
                "pools": self.layout,
                "streams": self.num_streams,
            },
            use_bin_type=True,
        )

    def add_peer(self, info: bytes) -> str:
        data = msgpack.unpackb(info, raw=False)
        if set(data["pools"]) != set(self.layout):
            raise TransferFailed(
                f"peer pools {sorted(data['pools'])} are not ours {sorted(self.layout)}: "
                "layouts disagree"
            )
        streams = data.get("streams")
        if not isinstance(streams, int) or isinstance(streams, bool) or streams < 1:
            raise TransferFailed(f"peer stream count {streams!r} is not a positive integer")
        with self._peers_lock:
            name = self.agent.add_remote_agent(data["metadata"])  # the same name again: a no-op
            if isinstance(name, bytes):
                name = name.decode()
            self._num_links[name] = self._num_links.get(name, 0) + 1
            if self._num_links[name] == 1:
                self.peers[name] = data
                if self.num_streams > 1:
                    self._streams[name] = ThreadPoolExecutor(
                        self.num_streams, thread_name_prefix=f"nixl-{name[-12:]}"
                    )
        return name

    def _descriptors(
        self, layout: dict[str, list[int]], copies: list[RegionCopy], side: str, mem_type: str
    ) -> Any:
        descs = []
        for copy in copies:
            base, size, stride, device = layout[copy.kind]
            index = copy.src if side == "src" else copy.dst
            for src, dst, nbytes in copy.byte_ranges(size):
                offset = src if side == "src" else dst
                if offset + nbytes > size:  # never write past a region (its neighbour's bytes)
                    raise TransferFailed(
                        f"a {copy.kind} piece [{offset}, {offset + nbytes}) is outside the "
                        f"{size}-byte {side} region: layouts disagree"
                    )
                descs.append((base + index * stride + offset, nbytes, device))
        return self.agent.get_xfer_descs(descs, mem_type)

    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        parts = split_parts(copies, self.num_streams)
        if not parts:
            return  # the receiver holds everything already: nothing to write or wait for
        if len(parts) == 1:  # always so with one stream
            self._guarded_write(peer, request_id, copies, part_tag(request_id, 0, 1), deadline)
            return
        futures = [
            self._streams[peer].submit(
                self._guarded_write,
                peer,
                request_id,
                part,
                part_tag(request_id, i, len(parts)),
                deadline,
            )
            for i, part in enumerate(parts)
        ]
        # Every part is waited for before raising: a handle is only released once its write
        # has finished or failed, never while it may still land.
        errors = [exc for future in futures if (exc := future.exception()) is not None]
        if errors:
            raise errors[0]

    def _guarded_write(
        self, peer: str, request_id: str, copies: list[RegionCopy], tag: bytes, deadline: float
    ) -> None:
        """`_write`, with anything NIXL raises reported as the transfer failure it is."""
        try:
            self._write(peer, request_id, copies, tag, deadline)
        except TransferFailed:
            raise
        except Exception as exc:  # nixl raises its own types (NIXL_ERR_* as RuntimeError...)
            raise TransferFailed(f"request {request_id}: NIXL write failed: {exc}") from exc

    def _write(
        self, peer: str, request_id: str, copies: list[RegionCopy], tag: bytes, deadline: float
    ) -> None:
        if time.monotonic() > deadline:  # queued behind this peer's earlier parts too long
            raise TransferFailed(f"request {request_id}: NIXL write did not start in time")
        remote = self.peers[peer]
        local_descs = self._descriptors(self.layout, copies, "src", self.mem_type)
        remote_descs = self._descriptors(remote["pools"], copies, "dst", remote["mem_type"])
        handle = self.agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, tag)
        try:
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferFailed(f"request {request_id}: NIXL write did not finish in time")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferFailed(f"request {request_id}: NIXL write failed")
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:  # a write still in flight cannot always be cancelled
                logger.warning("request %s: NIXL handle not released: %s", request_id, exc)

    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        num_parts = min(self.peers[peer]["streams"], len(copies))  # as split_parts cuts
        for part in range(num_parts):
            tag = part_tag(request_id, part, num_parts)
            while not self._take_notification(peer, tag):
                if time.monotonic() > deadline:
                    self._drop_notifications(peer, request_id)
                    raise TransferFailed(
                        f"request {request_id}: no NIXL completion from the peer in {timeout} s "
                        f"(part {part + 1} of {num_parts})"
                    )
                time.sleep(0.0002)

    def _take_notification(self, peer: str, tag: bytes) -> bool:
        """Whether `tag` arrived from `peer` (taking it); drains NIXL's new notifications."""
        with self._inbox_lock:
            for name, messages in self.agent.get_new_notifs().items():
                if isinstance(name, bytes):
                    name = name.decode()
                if self._abandoned:
                    messages = [m for m in messages if _request_of(m) not in self._abandoned]
                self._inbox.setdefault(name, set()).update(messages)
            inbox = self._inbox.get(peer)
            if inbox is None or tag not in inbox:
                return False
            inbox.remove(tag)
            return True

    def _drop_notifications(self, peer: str, request_id: str) -> None:
        """A failed receive: forget the parts that did arrive and those still to come (no one
        will take them)."""
        request = request_id.encode()
        with self._inbox_lock:
            inbox = self._inbox.get(peer, set())
            inbox.difference_update({m for m in inbox if _request_of(m) == request})
            self._abandoned[request] = None
            if len(self._abandoned) > NUM_ABANDONED_REMEMBERED:
                self._abandoned.popitem(last=False)

    def remove_peer(self, peer: str) -> None:
        """One link to `peer` closed; the last one forgets it."""
        with self._peers_lock:
            links = self._num_links.get(peer, 0) - 1
            if links > 0:
                self._num_links[peer] = links
                return
            self._forget(peer)

    def _forget(self, peer: str) -> None:
        """Drop `peer` whatever its links (under `_peers_lock`)."""
        self._num_links.pop(peer, None)
        streams = self._streams.pop(peer, None)
        if streams is not None:
            streams.shutdown()  # in-flight writes end before the agent goes
        with self._inbox_lock:
            self._inbox.pop(peer, None)
        if self.peers.pop(peer, None) is not None:
            self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        with self._peers_lock:
            for peer in list(self.peers):
                self._forget(peer)
        self.agent.deregister_memory(self._registered)
