"""The OpenAI routes over real HTTP without Ray: one colocated `EngineHost` in this process
behind uvicorn on a loopback port, for tests of what the API makes of a request and of the
output (tool calls, reasoning, the Responses API). Routing, P/D and the Serve deployment are
the service tests' (tests/service.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import uvicorn

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.engine_host.host import EngineHost
from hybridserve.cluster.engine_host.in_process import InProcessService
from hybridserve.cluster.openai.routes import OpenAIServer, api, current_server


@contextmanager
def local_api(**service: Any) -> Iterator[tuple[str, EngineHost]]:
    """(base URL, engine host) of the API served for a ServiceConfig of `service`."""
    config = ServiceConfig(**({"num_prefill": 0} | service))
    in_process = InProcessService(config)
    server = OpenAIServer(config, in_process)
    # NOTE: the routes' own app, bound to this server (nothing else serves it in a test run).
    api.dependency_overrides[current_server] = lambda: server
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(api, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the local API did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1", in_process.host
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        api.dependency_overrides.pop(current_server, None)
        in_process.shutdown()


def local_client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
