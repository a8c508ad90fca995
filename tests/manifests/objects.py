"""Reading `manifests/`: every object, its containers, its hybridserve workloads (the
RayService's Serve applications and the RayJobs' `hybridserve bench` entrypoints) and what
each Ray node group provides, so the tests can check one against the other."""

from __future__ import annotations

import shlex
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
APP_IMPORT_PATH = "hybridserve.cluster.control.app:build_app"


def manifest_files() -> list[Path]:
    return sorted(MANIFESTS.rglob("*.yaml"))


def load(path: Path) -> dict[str, Any]:
    """The one object of a manifest file (one object per file)."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(documents) == 1, f"{path.name}: {len(documents)} objects, expected one"
    return documents[0]


def cluster_spec(document: dict[str, Any]) -> dict[str, Any] | None:
    """The RayCluster spec of a RayCluster, RayService or RayJob."""
    spec = document.get("spec", {})
    return {
        "RayCluster": spec,
        "RayService": spec.get("rayClusterConfig"),
        "RayJob": spec.get("rayClusterSpec"),
    }.get(document["kind"])


def pod_specs(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod the object makes: Ray head and workers, a RayJob's
    submitter, a plain Pod."""
    if document["kind"] == "Pod":
        yield "pod", document["spec"]
    cluster = cluster_spec(document)
    if cluster:
        yield "head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs", []):
            yield f"worker group {group['groupName']}", group["template"]["spec"]
    submitter = document.get("spec", {}).get("submitterPodTemplate")
    if document["kind"] == "RayJob" and submitter:
        yield "submitter", submitter["spec"]


def containers(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, pod in pod_specs(document):
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield f"{where}/{container['name']}", container


def ray_pods(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod specs of the Ray nodes (head and workers)."""
    for where, pod in pod_specs(document):
        if where == "head" or where.startswith("worker group"):
            yield pod


@dataclass(frozen=True)
class NodeGroup:
    """What one Ray node group provides: logical CPUs and GPUs per pod, and how many pods."""

    name: str
    num_cpus: float
    num_gpus: int
    replicas: int
    max_replicas: int
    container_gpus: int  # nvidia.com/gpu in the Ray container's limits


def _quantity_cpus(value: str | int) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def node_groups(document: dict[str, Any]) -> list[NodeGroup]:
    cluster = cluster_spec(document)
    assert cluster is not None
    groups = [("head", cluster["headGroupSpec"], 1, 1)]
    groups += [
        (g["groupName"], g, g.get("replicas", g["minReplicas"]), g["maxReplicas"])
        for g in cluster.get("workerGroupSpecs", [])
    ]
    result = []
    for name, group, replicas, max_replicas in groups:
        params = group.get("rayStartParams", {})
        limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        container_gpus = int(limits.get("nvidia.com/gpu", 0))
        # Ray's defaults inside a pod: the container's CPU limit and GPU count.
        num_cpus = float(params.get("num-cpus", _quantity_cpus(limits.get("cpu", 1))))
        num_gpus = int(params.get("num-gpus", container_gpus))
        result.append(NodeGroup(name, num_cpus, num_gpus, replicas, max_replicas, container_gpus))
    return result


def serve_config(document: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(document["spec"]["serveConfigV2"])


def service_apps(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The hybridserve applications of a RayService's serveConfigV2."""
    return [
        app
        for app in serve_config(document)["applications"]
        if app["import_path"] == APP_IMPORT_PATH
    ]


def entrypoint_argv(document: dict[str, Any]) -> list[str]:
    return shlex.split(document["spec"]["entrypoint"])


def strict_model_problems(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Fields a pydantic model would ignore silently (Ray's Serve schemas ignore unknown
    keys): each one a problem, recursively through nested models and lists of them."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    names = {field.alias or name: name for name, field in fields.items()} | {n: n for n in fields}
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            problems.append(f"{where}: unknown field (the schema declares {sorted(fields)})")
            continue
        for nested in _models_in(fields[names[key]].annotation):
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                suffix = f"[{index}]" if isinstance(value, list) else ""
                problems += strict_model_problems(nested, item, where + suffix)
    return problems


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
