"""Transfer backends by name."""

from __future__ import annotations

from hybridserve.transceiver.base import Pools, TransferBackend


def _tcp(pools: Pools) -> TransferBackend:
    from hybridserve.transceiver.tcp_backend import TcpBackend

    return TcpBackend(pools)


def _nixl(pools: Pools) -> TransferBackend:
    # Imported on use: nixl loads UCX and its plugins, which the TCP path never needs.
    from hybridserve.transceiver.nixl_backend import NixlBackend

    return NixlBackend(pools)


BACKENDS = {"nixl": _nixl, "tcp": _tcp}


def create_backend(name: str, pools: Pools) -> TransferBackend:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown transfer backend {name!r} (choose one of: {', '.join(sorted(BACKENDS))})"
        )
    return BACKENDS[name](pools)
