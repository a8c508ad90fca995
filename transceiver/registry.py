"""Transfer backends by name."""

from __future__ import annotations

from hybridserve.transceiver.base import Pools, TransferBackend


def _tcp(pools: Pools, num_streams: int) -> TransferBackend:
    from hybridserve.transceiver.tcp_backend import TcpBackend

    return TcpBackend(pools)  # one stream: the control connection


def _nixl(pools: Pools, num_streams: int) -> TransferBackend:
    # Imported on use: nixl loads UCX and its plugins, which the TCP path never needs.
    from hybridserve.transceiver.nixl_backend import NixlBackend

    return NixlBackend(pools, num_streams)


BACKENDS = {"nixl": _nixl, "tcp": _tcp}


def create_backend(name: str, pools: Pools, num_streams: int = 1) -> TransferBackend:
    """`num_streams`: parallel streams per transfer where the backend has them (nixl)."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown transfer backend {name!r} (choose one of: {', '.join(sorted(BACKENDS))})"
        )
    return BACKENDS[name](pools, num_streams)
