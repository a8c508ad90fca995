"""Starting Ray and the service from a process: `hybridserve serve`, job entrypoints,
benchmarks and tests share these two steps."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

APP_NAME = "hybridserve"
logger = logging.getLogger(__name__)


def connect_ray(num_cpus: int | None = None) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local one on loopback."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            # A new cluster of our own, even if a `ray start` cluster runs on this machine
            # (joining one is what RAY_ADDRESS is for).
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )


def free_port() -> int:
    """A TCP port free on loopback now (for a service that must not take 8000)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deploy(
    config: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    name: str = APP_NAME,
    route_prefix: str = "/",
) -> str:
    """Run the service as the Serve application `name` under `route_prefix`; returns its
    base URL once every engine is up. `host` and `port` apply when this starts Serve on the
    cluster: Serve has one HTTP proxy per node, so on a cluster where Serve already runs (an
    earlier launch, another application) the application is served at that proxy's address,
    which is the one returned."""
    from ray import serve

    from hybridserve.cluster.app import build_app

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(config), name=name, route_prefix=route_prefix)
    host, port = serving_address()
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def serving_address() -> tuple[str, int]:
    """The host and port of the running Serve instance's HTTP proxies (fixed when Serve was
    first started on the cluster)."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config  # Serve has no public getter for it
    return http.host, http.port


def coordinator(name: str = APP_NAME) -> Any:
    """A handle on a running service's Coordinator (for probes, tests, benchmarks)."""
    from ray import serve

    return serve.get_deployment_handle("Coordinator", app_name=name)


def shutdown() -> None:
    """Take the service down. On a cluster we joined, only our application goes (others may
    run Serve apps there too); a cluster we started goes entirely."""
    import ray
    from ray import serve

    if os.environ.get("RAY_ADDRESS"):
        serve.delete(APP_NAME)
    else:
        serve.shutdown()
    ray.shutdown()
