"""Pure-Python backend: region bytes over the control channel's TCP socket.

Each region travels as a `DataFrame` header (kind, destination, size) then its raw bytes,
received straight into the destination pool (`recv_into` a view of the block: no extra copy
on the CPU; GPU pools go through a host staging buffer).
"""

from __future__ import annotations

import torch

from hybridserve.transceiver.base import RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.protocol import CONTROL_MAX_BYTES, DataFrame, TransferAbort


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TcpBackend(TransferBackend):
    name = "tcp"

    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        for copy in copies:
            region = self.pools.region(copy.kind, copy.src)
            view = _byte_view(region.cpu() if region.is_cuda else region)
            ranges = copy.byte_ranges(len(view))
            nbytes = sum(n for _, _, n in ranges)
            channel.send(DataFrame(request_id, copy.kind, copy.dst, nbytes))
            for start, _, n in ranges:
                channel.send_bytes(view[start : start + n])

    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        for copy in copies:
            # The header is checked against the plan before a byte of data is read.
            frame = channel.receive(timeout, max_bytes=CONTROL_MAX_BYTES)
            if isinstance(frame, TransferAbort):
                raise TransferFailed(f"request {request_id}: sender aborted: {frame.reason}")
            region = self.pools.region(copy.kind, copy.dst)
            ranges = copy.byte_ranges(region.numel() * region.element_size())
            nbytes = sum(n for _, _, n in ranges)
            if not isinstance(frame, DataFrame) or (
                frame.request_id,
                frame.kind,
                frame.dst,
                frame.nbytes,
            ) != (request_id, copy.kind, copy.dst, nbytes):
                raise TransferFailed(
                    f"request {request_id}: expected {nbytes} bytes of {copy.kind} for "
                    f"destination {copy.dst}, the peer sent {frame!r} (stale or out-of-range "
                    "destination)"
                )
            if region.is_cuda:
                staging = torch.empty_like(region, device="cpu")
                view = _byte_view(staging)
                for _, start, n in ranges:
                    channel.receive_into(view[start : start + n], timeout)
                target = region.reshape(-1).view(torch.uint8)
                source = staging.reshape(-1).view(torch.uint8)
                for _, start, n in ranges:  # only the ranges: the rest of the region is not ours
                    target[start : start + n].copy_(source[start : start + n])
            else:
                view = _byte_view(region)
                for _, start, n in ranges:
                    channel.receive_into(view[start : start + n], timeout)
