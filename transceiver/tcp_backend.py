"""Pure-Python backend: region bytes over the control channel's TCP socket.

Each region travels as a `DataFrame` header (kind, destination, size) then its raw bytes,
received straight into the destination pool (`recv_into` a view of the block: no extra copy
on the CPU; GPU pools go through a host staging buffer).
"""

from __future__ import annotations

import torch

from hybridserve.transceiver.base import RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.protocol import DataFrame, TransferAbort


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
            host = region.cpu() if region.is_cuda else region
            nbytes = host.numel() * host.element_size()
            channel.send(DataFrame(request_id, copy.kind, copy.dst, nbytes))
            channel.send_bytes(_byte_view(host))

    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        for copy in copies:
            frame = channel.receive(timeout)
            if isinstance(frame, TransferAbort):
                raise TransferFailed(f"request {request_id}: sender aborted: {frame.reason}")
            region = self.pools.region(copy.kind, copy.dst)
            nbytes = region.numel() * region.element_size()
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
                channel.receive_into(_byte_view(staging), timeout)
                region.copy_(staging)
            else:
                channel.receive_into(_byte_view(region), timeout)
