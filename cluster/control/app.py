"""The Serve application: `build_app`, and the ingress deployment.

    import_path: hybridserve.cluster.control.app:build_app      args: a ServiceConfig dict

The ingress serves the OpenAI routes (cluster/openai/routes.py) with one `OpenAIServer` per
replica over its link to the service (`ServiceClient`); the Coordinator deployment starts and
supervises the engines and the router (cluster/control/coordinator.py).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.control.coordinator import Coordinator
from hybridserve.cluster.control.service_client import ServiceClient
from hybridserve.cluster.openai.routes import OpenAIServer, api, current_server


def _replica_server() -> OpenAIServer:
    """The routes' server: this replica's."""
    return serve.get_replica_context().servable_object.server


# NOTE: before `serve.ingress`, which freezes a copy of the app.
api.dependency_overrides[current_server] = _replica_server


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, config: dict[str, Any], coordinator: Any) -> None:
        self.server = OpenAIServer(ServiceConfig(**config), ServiceClient(coordinator))


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for `args` (a ServiceConfig dict; validated here, so a typo
    fails the deploy with the field named)."""
    config = ServiceConfig(**args)
    dumped = config.model_dump()
    return OpenAIIngress.bind(dumped, Coordinator.bind(dumped))
