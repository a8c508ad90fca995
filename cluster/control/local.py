"""Starting Ray and the service from a process: `hybridserve serve`, job entrypoints,
benchmarks and tests share these two steps."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

APP_NAME = "hybridserve"
logger = logging.getLogger(__name__)

# Serve's throughput-optimized mode (Ray >= 2.55), for a cluster we start: the ingress
# replica also takes HTTP itself ("direct ingress": no proxy hop, and no Ray object, per SSE
# chunk), runs request code on its own event loop rather than on a thread of its own, and
# buffers its access log: less CPU per streamed token on the cores the engines step on
# (bench/service_overhead.py measures through it). Serve reads these when its processes
# start, so they must be in the environment before the cluster is; a cluster we join keeps
# its own settings (the KubeRay manifests keep Serve's proxy on every node: their readiness
# probes ask it). An explicit value in the environment wins. No load balancer fronts a
# cluster we start, so an ingress replica that stops need not stay open for one to notice
# (Serve holds it 30 s by default, on every application deleted).
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
}


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
        for name, value in SERVE_ENV.items():
            os.environ.setdefault(name, value)  # inherited by the raylet, so by every worker
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

    from hybridserve.cluster.control.app import build_app

    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_app(config), name=name, route_prefix=route_prefix)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} {_why_not_running(name)}".strip()) from None
    host, port = serving_address()
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def _why_not_running(name: str) -> str:
    """What Serve says about an application that failed to deploy: each failed deployment's
    own message (a constructor's exception), which its generic error leaves out."""
    from ray import serve

    application = serve.status().applications.get(name)
    if application is None:
        return ""
    messages = [
        f"{deployment}: {status.message}"
        for deployment, status in application.deployments.items()
        if status.message
    ]
    return " ".join(messages) or application.message


def serving_address() -> tuple[str, int]:
    """The host and port of the running Serve instance's HTTP proxies (fixed when Serve was
    first started on the cluster)."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config  # Serve has no public getter for it
    return http.host, http.port


def direct_url(name: str = APP_NAME) -> str | None:
    """The base URL at which the application's ingress replica takes HTTP itself, when Serve
    runs with direct ingress (SERVE_ENV); None otherwise. The proxy's address
    (`serving_address`) serves the application either way; this one skips the proxy. With
    several ingress replicas, the first one's."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    for group in client.get_serve_details().get("target_groups", []):
        # Only direct-ingress groups name their ingress deployment; proxy groups leave it "".
        if group.get("app_name") != name or not group.get("ingress_deployment_name"):
            continue
        if group.get("protocol") != "HTTP" or not group.get("targets"):
            continue
        target = group["targets"][0]
        # A replica listens on Serve's HTTP host: a loopback service is only there, and a
        # wildcard host is reached at the replica's node address.
        bound, _ = serving_address()
        host = target["ip"] if bound in ("0.0.0.0", "::", "") else bound
        return f"http://{host}:{target['port']}{group['route_prefix'].rstrip('/')}"
    return None


def coordinator(name: str = APP_NAME) -> Any:
    """A handle on a running service's Coordinator (for probes, tests, benchmarks)."""
    from ray import serve

    handle = serve.get_deployment_handle("Coordinator", app_name=name)
    # Callers wait on it from plain code (`.remote().result()`); a handle that routes on the
    # caller's event loop (the default in a process with SERVE_ENV) refuses that.
    if not handle.is_initialized:  # Serve hands out one handle per deployment
        handle._init(_run_router_in_separate_loop=True)
    return handle


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
