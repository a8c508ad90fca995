"""torch.distributed for one engine's ranks: the collectives of a tensor-parallel forward pass,
and the control channel that carries rank messages (step plans) from rank 0 to every rank.

Each engine builds its own process groups over its own store, outside torch's global default
group, so one process can hold several engines (tests do, and the service may). Two groups: the
device group (NCCL on CUDA, gloo on the CPU) for activations, and a gloo group for the control
channel, whose payloads are host bytes; on the CPU they are one group. Nothing is pickled: a
payload is msgpack bytes, broadcast as a length and a uint8 tensor.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives wait this long for a peer. The engine's watchdog bounds a step far tighter
# (`distributed_timeout_seconds`) by stopping the ranks, which unblocks every waiting
# collective at once; this one only has to outlast an idle engine (ranks wait for the next
# plan inside a broadcast).
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class CollectiveStats:
    """What the collectives of this rank did since the last `reset` (bench/tp.py reads it)."""

    num_calls: int = 0
    seconds: float = 0.0
    bytes_all_reduced: int = 0
    bytes_gathered: int = 0

    def reset(self) -> None:
        self.num_calls, self.seconds = 0, 0.0
        self.bytes_all_reduced = self.bytes_gathered = 0


class Group:
    """One process group of an engine's ranks (the raw torch object, not registered with
    torch.distributed's global state)."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        # The latest collective's Work, kept until the next one replaces it. Whoever drops a
        # Work last runs its destructor, which frees the tensors it holds and so needs the
        # GIL. Left to gloo's worker thread, that can happen while the interpreter exits
        # (a rank's last message is `stop`); a thread that asks for the GIL then is ended
        # inside a C++ destructor, and the process aborts ("terminate called without an
        # active exception"). Kept here, the Work dies in a Python thread.
        self._latest: dist.Work | None = None

    def _wait(self, work: dist.Work) -> None:
        work.wait()
        self._latest = work

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.pg.broadcast([tensor], options))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait(self.pg.allreduce([tensor], options))

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (equal shapes) on rank 0; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = (
            [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        self._wait(self.pg.gather([parts] if parts is not None else [], [tensor], options))
        return parts


class TorchCollectives:
    """`Collectives` over an engine's device group, timed. With `synchronize` (a GPU
    benchmark), the device is synchronised around each call so the time is the collective's,
    not its launch's."""

    def __init__(self) -> None:
        self.group: Group | None = None  # bound once the group exists
        self.stats = CollectiveStats()
        self.synchronize = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        start = self._start(tensor)
        self.group.all_reduce(tensor)
        self._stop(tensor, start)
        self.stats.bytes_all_reduced += tensor.numel() * tensor.element_size()
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        assert self.group is not None
        start = self._start(tensor)
        parts = self.group.gather(tensor)
        self._stop(tensor, start)
        self.stats.bytes_gathered += tensor.numel() * tensor.element_size()
        return parts

    def _start(self, tensor: torch.Tensor) -> float:
        if self.synchronize and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        return time.perf_counter()

    def _stop(self, tensor: torch.Tensor, start: float) -> None:
        if self.synchronize and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        self.stats.num_calls += 1
        self.stats.seconds += time.perf_counter() - start


class ControlChannel:
    """Bytes from rank 0 to every rank (`broadcast`), and every rank's bytes back to rank 0
    (`gather`), over a gloo group."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def broadcast(self, payload: bytes | None = None) -> bytes:
        """Rank 0 passes `payload`; every rank returns it."""
        rank = self.group.rank
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self.group.broadcast(size)
        if rank == 0:
            assert payload
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.group.broadcast(data)
        return payload if rank == 0 else data.numpy().tobytes()  # type: ignore[return-value]

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank passes its bytes; rank 0 gets them all, in rank order (None elsewhere)."""
        longest = torch.tensor([len(payload)], dtype=torch.int64)
        self.group.all_reduce(longest, dist.ReduceOp.MAX)
        data = torch.zeros(int(longest) + 8, dtype=torch.uint8)
        data[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        if payload:
            data[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = self.group.gather(data)
        if parts is None:
            return None
        return [p[8 : 8 + int(p[:8].view(torch.int64))].numpy().tobytes() for p in parts]


def init_groups(
    store: dist.Store, rank: int, world_size: int, device: torch.device
) -> tuple[Group, Group]:
    """This engine's (device group, control group); the same gloo group on the CPU."""
    control = Group(
        dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world_size, IDLE_TIMEOUT),
        rank,
        world_size,
    )
    if device.type != "cuda":
        return control, control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = IDLE_TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, world_size, options)
    return Group(nccl, rank, world_size), control
