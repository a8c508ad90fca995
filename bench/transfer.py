"""Transfer bandwidth between two OS processes: the NIXL and TCP backends against memcpy.

    python bench/transfer.py [--sizes-mib 16 64 256 1024] [--repeats 5] [--region-kib 1024]
                             [--backends nixl tcp] [--streams 2]
                             [--output bench/results/transfer.json]

For each size, in one run: a same-process copy of that many bytes (the memcpy ceiling: torch
`copy_` with its intra-op threads, plus numpy's single-threaded `copyto` for reference), then
each backend moving that many bytes from a sender process to this one. Every repeat runs all
columns back to back, so load from elsewhere on the machine hits them alike. The backends run
as the engine uses them: both sides register one pool of the largest size once (`Pools.kv`,
split into `--region-kib` regions), exchange `local_info` / `add_peer`, and per transfer the
receiver sends a `ReceivePlan`, the sender turns it into `RegionCopy`s (`region_copies`),
calls `backend.send` and sends `TransferDone`. The timed window is the receiver's: plan sent
-> `backend.receive` returned and `TransferDone` received.

    this process (receiver, timing)            peer process (sender, spawned)
    pool = dst, zeroed before each repeat      pool = src, filled with a seeded pattern
    ReceivePlan(dst ids, shuffled) ------->    region_copies -> backend.send
    backend.receive                <-- data --
    TransferDone received          <---------  TransferDone
    check every region's checksum against the sender's

GB/s is bytes moved / seconds (1 GB = 1e9 bytes), for memcpy too (not read + write). Each size
is warmed up, then repeated; best and median are kept, and the table shows the best. Every
transferred region is verified (destinations are zeroed first), so a backend that skips bytes
fails the run instead of reporting a figure. Without nixl the NIXL column says so and is
skipped. Pools and the memcpy buffers come from the engine's allocator
(`workers.host_memory.zeroed_pool`: 2 MiB aligned, on transparent huge pages where the kernel
allows), so the ceiling and the backends copy the same kind of memory.

`--tp 2` (a second table): prefill TP 2 -> decode TP 1, as engines of different TP sizes move
state. Each region is (16 runs of layers x K|V, 2 KV heads, rows), sharded by head: two sender
processes (prefill ranks 0 and 1) each hold one head of every region and send it to this
process at once, rank 0 over the transfer link and rank 1 over its shard link; each region
arrives as 16 strided pieces from each rank (`tp_mapping.region_pieces`). The bytes per rank
pair, GB/s against memcpy of the same total, and the verification (every region equal to the
unsharded source) are reported per size.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import torch

from hybridserve.bench.common import machine, write_result
from hybridserve.transceiver.base import Pools, RegionCopy, region_copies
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.protocol import ReceivePlan, TransferDone
from hybridserve.transceiver.registry import create_backend
from hybridserve.transceiver.tp_mapping import RegionShape, plan, region_pieces
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.runner.host_memory import zeroed_pool

MIB = 1 << 20
CPU = torch.device("cpu")
TIMEOUT_S = 120.0
_BLOB_LENGTH = struct.Struct(">Q")
# Multiplicative hash (odd, < 2**63): every int64 word of the source pool differs.
_PATTERN = 0x5851F42D4C957F2D
# Fractions of memcpy each backend should reach at >= 256 MiB (reported, not asserted).
TARGETS = {"nixl": 0.50, "tcp": 0.25}
# The TP case's region: 16 runs (layers x K|V) of 2 heads, sharded by head.
TP_RUNS, TP_HEADS = 16, 2


# --- pools and checksums ---------------------------------------------------------------------


def fill_pattern(pool: torch.Tensor, seed: int) -> None:
    """Write (word index + seed) * _PATTERN into every int64 word (in 16 MiB steps)."""
    words = pool.view(-1).view(torch.int64)
    step = (16 * MIB) // 8
    for start in range(0, words.numel(), step):
        chunk = torch.arange(start, min(start + step, words.numel()), dtype=torch.int64)
        words[start : start + chunk.numel()].copy_(chunk.add_(seed).mul_(_PATTERN))


def region_sums(pool: torch.Tensor, indices: list[int]) -> list[int]:
    """One int64 sum per region (wrapping): tells regions apart and catches missing bytes."""
    return [int(pool[i].view(torch.int64).sum()) for i in indices]


def _tp_shapes(region_bytes: int, tp: int) -> tuple[RegionShape, RegionShape]:
    """(a TP-`tp` rank's region, the unsharded region) of the TP case's layout."""
    row = region_bytes // (TP_RUNS * TP_HEADS)
    return RegionShape(TP_RUNS, TP_HEADS // tp, row), RegionShape(TP_RUNS, TP_HEADS, row)


def head_shard(pool: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s heads of every region (a new pool, laid out as that rank's)."""
    heads = TP_HEADS // tp
    shaped = pool.view(len(pool), TP_RUNS, TP_HEADS, -1)[:, :, rank * heads : (rank + 1) * heads]
    shard = zeroed_pool((len(pool), pool.shape[1] // tp), torch.uint8, CPU)
    shard.view(len(pool), TP_RUNS, heads, -1).copy_(shaped)
    return shard


def rank_pieces(region_bytes: int, tp: int, rank: int) -> tuple[tuple[int, int, int], ...]:
    """Byte pieces from TP-`tp` rank `rank`'s region into the unsharded (TP 1) region."""
    src, dst = _tp_shapes(region_bytes, tp)
    fragments = [f for f in plan((TP_HEADS,), tp, 1) if f.src_rank == rank]
    return tuple(region_pieces(fragments, (TP_HEADS,), src, dst, tp, 1))


# --- control: raw length-prefixed blobs for the handshake ------------------------------------


def send_blob(channel: Channel, data: bytes) -> None:
    channel.send_bytes(_BLOB_LENGTH.pack(len(data)) + data)


def receive_blob(channel: Channel) -> bytes:
    header = bytearray(_BLOB_LENGTH.size)
    channel.receive_into(memoryview(header))
    (length,) = _BLOB_LENGTH.unpack(header)
    data = bytearray(length)
    channel.receive_into(memoryview(data))
    return bytes(data)


# --- the peer process: a sender --------------------------------------------------------------


def serve_sender(args: argparse.Namespace) -> None:
    """Peer mode: register a source pool, then send whatever each ReceivePlan asks for until
    the receiver closes the link."""
    pool = zeroed_pool((args.num_regions, args.region_bytes), torch.uint8, CPU)
    fill_pattern(pool, args.seed)
    sums = region_sums(pool, list(range(len(pool))))  # of the unsharded regions
    pieces: tuple[tuple[int, int, int], ...] = ()
    if args.tp > 1:  # keep this rank's head of every region, and send it as pieces
        pool = head_shard(pool, args.tp, args.tp_rank)
        pieces = rank_pieces(args.region_bytes, args.tp, args.tp_rank)
    backend = create_backend(args.serve_sender, Pools({"kv": pool}), args.streams)
    channel = Channel.connect(("127.0.0.1", args.port), TIMEOUT_S)
    try:
        send_blob(
            channel,
            msgpack.packb(
                {"info": backend.local_info(), "sums": sums},
                use_bin_type=True,
            ),
        )
        peer = backend.add_peer(receive_blob(channel))
        while True:
            try:
                plan = channel.receive(timeout=TIMEOUT_S)
            except TransferFailed as exc:
                if "closed the connection" in str(exc):
                    return  # the receiver is done
                raise
            assert isinstance(plan, ReceivePlan), plan
            # Source region i goes to the plan's i-th destination (the engine's path).
            copies = region_copies(
                backend.pools,
                list(range(len(plan.dst_block_ids))),
                -1,
                plan,
                {"kv": pieces} if pieces else None,
            )
            backend.send(channel, peer, plan.request_id, copies, TIMEOUT_S)
            channel.send(TransferDone(plan.request_id))
    finally:
        channel.close()
        backend.close()


# --- this process: memcpy and the receiving side ---------------------------------------------


class Memcpy:
    """The ceiling: a same-process copy of `nbytes` between two touched CPU buffers, with
    torch's `copy_` (its intra-op threads) and with numpy's single-threaded `copyto`."""

    def __init__(self, nbytes: int) -> None:
        self.src = zeroed_pool((nbytes,), torch.uint8, CPU)
        fill_pattern(self.src.view(1, -1), seed=1)
        self.dst = zeroed_pool((nbytes,), torch.uint8, CPU)
        self.dst.copy_(self.src)  # warm-up: faults the destination pages in
        np.copyto(self.dst.numpy(), self.src.numpy())

    def copy(self, *, single_thread: bool = False) -> float:
        self.dst.zero_()
        start = time.perf_counter()
        if single_thread:
            np.copyto(self.dst.numpy(), self.src.numpy())
        else:
            self.dst.copy_(self.src)
        seconds = time.perf_counter() - start
        assert torch.equal(self.dst, self.src)
        return seconds


class SenderLink:
    """A spawned sender process (prefill rank `rank` of `tp`) and its link to this process.

    Construction spawns the sender; `connect` waits for it and swaps backend info (split so
    that several senders start in parallel). `close` works in either state."""

    def __init__(
        self, backend: str, num_regions: int, region_bytes: int, seed: int, streams: int,
        tp: int, rank: int,
    ) -> None:  # fmt: skip
        self.backend_name = backend
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-sender",
                backend,
                "--port",
                str(self.server.getsockname()[1]),
                "--num-regions",
                str(num_regions),
                "--region-bytes",
                str(region_bytes),
                "--seed",
                str(seed),
                "--streams",
                str(streams),
                "--tp",
                str(tp),
                "--tp-rank",
                str(rank),
            ],
            stdout=subprocess.DEVNULL,  # NIXL / UCX log lines; errors still reach stderr
        )
        self.channel: Channel | None = None
        self.peer = ""
        self.src_sums: list[int] = []

    def connect(self, backend: Any) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.channel is None:
            try:
                self.channel = Channel(self.server.accept()[0], TIMEOUT_S)
            except TimeoutError:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the {self.backend_name} sender process exited with "
                        f"{self.process.returncode} before connecting"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {self.backend_name} sender did not connect in {TIMEOUT_S} s"
                    ) from None
        self.server.close()
        hello = msgpack.unpackb(receive_blob(self.channel), raw=False)
        self.src_sums = hello["sums"]
        self.peer = backend.add_peer(hello["info"])
        send_blob(self.channel, backend.local_info())

    def close(self) -> None:
        """Closing the link ends the sender; a sender that never connected is killed."""
        self.server.close()
        if self.channel is not None:
            self.channel.close()
        else:
            self.process.kill()
        code = self.process.wait(timeout=60)
        if code != 0 and self.channel is not None:
            raise RuntimeError(f"the {self.backend_name} sender process exited with {code}")


class Receiver:
    """This process's end: a destination pool registered once, and one spawned sender per
    prefill rank (one at TP 1; with `tp` > 1 each sends its head of every region, at once)."""

    def __init__(
        self, backend: str, num_regions: int, region_bytes: int, seed: int, streams: int,
        tp: int = 1,
    ) -> None:  # fmt: skip
        self.pool = zeroed_pool((num_regions, region_bytes), torch.uint8, CPU)  # pages touched
        self.backend = create_backend(backend, Pools({"kv": self.pool}), streams)
        self.tp = tp
        self.pieces = [rank_pieces(region_bytes, tp, r) if tp > 1 else () for r in range(tp)]
        self.links = [
            SenderLink(backend, num_regions, region_bytes, seed, streams, tp, rank)
            for rank in range(tp)
        ]
        self.count = 0

    def connect(self) -> None:
        for link in self.links:
            link.connect(self.backend)

    def _receive(self, link: SenderLink, request_id: str, copies: list[RegionCopy]) -> None:
        assert link.channel is not None, "connect() first"
        self.backend.receive(link.channel, link.peer, request_id, copies, TIMEOUT_S)
        done = link.channel.receive(TIMEOUT_S)
        if not isinstance(done, TransferDone) or done.request_id != request_id:
            raise RuntimeError(f"expected TransferDone for {request_id}, got {done!r}")

    def transfer(self, dst_ids: list[int]) -> float:
        """Move regions 0..n-1 of the senders' pools to `dst_ids`; returns seconds, verified."""
        for dst in dst_ids:
            self.pool[dst].zero_()  # a stale copy from the previous repeat cannot pass
        self.count += 1
        request_id = f"bench-{self.count}"
        copies = [[RegionCopy("kv", -1, dst, pieces) for dst in dst_ids] for pieces in self.pieces]
        start = time.perf_counter()
        for link in self.links:
            assert link.channel is not None, "connect() first"
            link.channel.send(ReceivePlan(request_id, 0, dst_ids, -1))
        if len(self.links) == 1:
            self._receive(self.links[0], request_id, copies[0])
        else:  # every rank pair at once, as shard links move
            with ThreadPoolExecutor(len(self.links)) as pool:
                jobs = [
                    pool.submit(self._receive, link, request_id, rank_copies)
                    for link, rank_copies in zip(self.links, copies, strict=True)
                ]
                for job in jobs:
                    job.result()
        seconds = time.perf_counter() - start
        got = region_sums(self.pool, dst_ids)
        want = self.links[0].src_sums[: len(dst_ids)]  # of the unsharded regions
        if got != want:
            bad = sum(g != w for g, w in zip(got, want, strict=True))
            raise RuntimeError(
                f"{self.backend.name}: {bad} of {len(dst_ids)} regions arrived wrong: the "
                "figure would be fake"
            )
        return seconds

    def close(self) -> None:
        try:
            for link in self.links:
                link.close()
        finally:
            self.backend.close()


def measure(
    backends: list[str],
    sizes: list[int],
    region_bytes: int,
    repeats: int,
    seed: int,
    streams: int,
    tp: int = 1,
) -> dict[str, dict[int, list[float]]]:
    """Seconds per repeat for memcpy and each backend. Every repeat runs memcpy then each
    backend back to back, so a load spike from elsewhere hits all columns alike."""
    num_regions = max(sizes) // region_bytes
    receivers: dict[str, Receiver] = {}
    rng = random.Random(seed)
    columns = ["memcpy", "memcpy_1thread", *backends]
    out: dict[str, dict[int, list[float]]] = {name: {} for name in columns}
    try:
        for name in backends:
            receivers[name] = Receiver(name, num_regions, region_bytes, seed, streams, tp)
        for receiver in receivers.values():
            receiver.connect()
        for nbytes in sizes:
            memcpy = Memcpy(nbytes)
            # Scattered destinations, as an engine's free blocks are.
            dst_ids = rng.sample(range(num_regions), nbytes // region_bytes)
            for receiver in receivers.values():
                receiver.transfer(dst_ids)  # warm-up
            for times in out.values():
                times[nbytes] = []
            for _ in range(repeats):
                out["memcpy"][nbytes].append(memcpy.copy())
                out["memcpy_1thread"][nbytes].append(memcpy.copy(single_thread=True))
                for name, receiver in receivers.items():
                    out[name][nbytes].append(receiver.transfer(dst_ids))
            del memcpy
    finally:
        for receiver in receivers.values():
            receiver.close()
    return out


def summary(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {
        "best_s": min(seconds),
        "median_s": statistics.median(seconds),
        "best_gb_per_s": nbytes / min(seconds) / 1e9,
        "median_gb_per_s": nbytes / statistics.median(seconds) / 1e9,
    }


def nixl_missing() -> str | None:
    """Why the nixl backend cannot load here, or None."""
    try:
        import nixl._api  # noqa: F401 - loads UCX; the backend needs it anyway
    except Exception as exc:  # not installed, or an install without its libraries
        return f"{type(exc).__name__}: {exc}"
    return None


def build_rows(
    sizes: list[int], seconds: dict[str, dict[int, list[float]]], backends: list[str]
) -> list[dict[str, Any]]:
    """One row per size: memcpy (torch's threads and 1 thread), then each backend with its
    fraction of both (None for a skipped backend)."""
    rows = []
    for n in sizes:
        memcpy = summary(n, seconds["memcpy"][n])
        single = summary(n, seconds["memcpy_1thread"][n])
        row: dict[str, Any] = {
            "size_mib": n // MIB,
            "bytes": n,
            "memcpy": memcpy,
            "memcpy_1thread": single,
        }
        for backend in backends:
            if backend not in seconds:
                row[backend] = None
                continue
            stats: dict[str, float] = summary(n, seconds[backend][n])
            for stat in ("best", "median"):
                got = stats[f"{stat}_gb_per_s"]
                stats[f"{stat}_fraction_of_memcpy"] = got / memcpy[f"{stat}_gb_per_s"]
                stats[f"{stat}_fraction_of_memcpy_1thread"] = got / single[f"{stat}_gb_per_s"]
            row[backend] = stats
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], backends: list[str], repeats: int) -> None:
    def cell(stats: dict[str, float] | None) -> str:
        if stats is None:
            return f"{'skipped':>17}"
        return f"{stats['best_gb_per_s']:>9.2f} ({stats['best_fraction_of_memcpy']:>4.0%})"

    print(
        f"best of {repeats}; GB/s = 1e9 bytes/s; % of memcpy (torch copy_, "
        f"{torch.get_num_threads()} threads) at the same size"
    )
    header = f"{'size MiB':>8} {'memcpy GB/s':>11}"
    header += "".join(f" {name + ' GB/s (%)':>17}" for name in backends)
    print(header + f" {'1-thread memcpy GB/s':>20}")
    for row in rows:
        line = f"{row['size_mib']:>8} {row['memcpy']['best_gb_per_s']:>11.2f}"
        line += "".join(f" {cell(row[name])}" for name in backends)
        print(line + f" {row['memcpy_1thread']['best_gb_per_s']:>20.2f}")
    for backend, target in TARGETS.items():
        big = [r[backend] for r in rows if r["bytes"] >= 256 * MIB and r.get(backend)]
        if big:
            worst = min(s["best_fraction_of_memcpy"] for s in big)
            verdict = "met" if worst >= target else "NOT met"
            print(
                f"target {backend} >= {target:.0%} of memcpy at >= 256 MiB: {verdict} "
                f"(lowest {worst:.0%})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size")
    parser.add_argument("--region-kib", type=int, default=1024, help="bytes per RegionCopy")
    parser.add_argument("--backends", nargs="+", default=["nixl", "tcp"], choices=["nixl", "tcp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--streams",
        type=int,
        default=EngineConfig.model_fields["transfer_streams"].default,
        help="nixl streams per transfer on both sides (default: the engine's)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        choices=[1, 2],
        help="2: prefill TP 2 -> decode TP 1, every region from two sender ranks at once",
    )
    parser.add_argument("--output", default="bench/results/transfer.json")
    # Peer mode (this script spawns itself as the sender).
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--serve-sender", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-regions", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--region-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sender:
        serve_sender(args)
        return

    region_bytes = args.region_kib * 1024
    sizes = [mib * MIB for mib in args.sizes_mib]
    if args.streams < 1 or args.repeats < 1 or any(s <= 0 or s % region_bytes for s in sizes):
        parser.error(
            "--streams and --repeats must be >= 1 and every size a positive multiple of "
            f"--region-kib ({args.region_kib} KiB); got streams {args.streams}, repeats "
            f"{args.repeats}, sizes {args.sizes_mib} MiB"
        )

    skipped: dict[str, str] = {}
    if "nixl" in args.backends and (reason := nixl_missing()) is not None:
        print(f"nixl is not importable ({reason}): skipping the nixl column")
        skipped["nixl"] = reason
    running = [b for b in args.backends if b not in skipped]
    seconds = measure(running, sizes, region_bytes, args.repeats, args.seed, args.streams, args.tp)
    rows = build_rows(sizes, seconds, args.backends)
    if args.tp > 1:
        print(
            f"prefill TP {args.tp} -> decode TP 1: each size is {args.tp} rank pairs of "
            f"size / {args.tp} bytes, {TP_RUNS} strided pieces per region and pair, at once"
        )
        for row in rows:
            row["bytes_per_rank_pair"] = row["bytes"] // args.tp
            row["verified"] = True  # transfer() raises on any region that differs
    print_table(rows, args.backends, args.repeats)

    result = {
        "benchmark": "transfer",
        "config": {
            "sizes_mib": args.sizes_mib,
            "repeats": args.repeats,
            "region_bytes": region_bytes,
            "backends": args.backends,
            "seed": args.seed,
            "nixl_streams": args.streams,
            "tp": f"prefill TP {args.tp} -> decode TP 1" if args.tp > 1 else None,
            "timed_window": "ReceivePlan sent -> backend.receive done + TransferDone received",
        },
        "machine": machine(),
        "skipped": skipped,
        "targets": {f"{b}_fraction_of_memcpy": t for b, t in TARGETS.items()},
        "rows": rows,
    }
    write_result(args.output, result)


if __name__ == "__main__":
    main()
