"""The CPU variants (`manifests/local/`) run, on a Ray cluster that stands in for the
manifest's pods: `ray start --head` with the pods' environment (Secret references resolved)
and as many logical CPUs as its node groups provide, the volumes' mount paths pointed at
temporary folders. Manifests whose pods look alike share the cluster.

- Each RayJob's entrypoint runs through `ray job submit` with its runtimeEnvYAML: exit 0, and
  its result JSON lands on the results volume with no failed request, the topology it launched
  and every engine alive.
- The RayService's serveConfigV2 goes through `serve deploy` (only the HTTP address moved to
  loopback and a free port); the official `openai` client gets a chat completion with the
  Secret's key, and every probe of the manifest answers 200 on the port it names.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from hybridserve.cluster.config import API_KEYS_ENV
from hybridserve.cluster.control.local import free_port
from hybridserve.workers import LLM, SamplingParams
from tests.manifests.objects import (
    MANIFESTS,
    containers,
    entrypoint_argv,
    load,
    node_groups,
    ray_pods,
    serve_config,
)
from tests.ray_head import RayHead, ray_head

LOCAL = MANIFESTS / "local"
SECRETS = {
    doc["metadata"]["name"]: doc
    for doc in (load(path) for path in MANIFESTS.glob("*.yaml"))
    if doc["kind"] == "Secret"
}
DEPLOY_TIMEOUT_S = 300


def pod_env(document: dict[str, Any]) -> dict[str, str]:
    """The environment the manifest gives its Ray containers, Secret references resolved."""
    env: dict[str, str] = {}
    for pod in ray_pods(document):
        for variable in pod["containers"][0].get("env", []):
            if "value" in variable:
                env[variable["name"]] = variable["value"]
                continue
            ref = variable["valueFrom"]["secretKeyRef"]
            env[variable["name"]] = SECRETS[ref["name"]]["stringData"][ref["key"]]
    return env


def mounted(document: dict[str, Any], root: Path) -> dict[str, Path]:
    """Each volume mount path of the Ray pods -> a folder of its own under `root`."""
    paths = {}
    for pod in ray_pods(document):
        for mount in pod["containers"][0].get("volumeMounts", []):
            paths[mount["mountPath"]] = root / mount["name"]
            paths[mount["mountPath"]].mkdir(exist_ok=True)
    return paths


def localized(argv: list[str], mounts: dict[str, Path]) -> list[str]:
    result = []
    for arg in argv:
        for mount_path, folder in mounts.items():
            if arg == mount_path or arg.startswith(f"{mount_path}/"):
                arg = str(folder) + arg[len(mount_path) :]
        result.append(arg)
    return result


def result_files(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--output"]


# What each local RayJob launches: its topology label and the prefill engine's placement.
LAUNCHED = {
    "rayjob-bench.yaml": (
        "1P(TP2)1D(TP1)",
        {"ranks": 2, "bundle": {"CPU": 1.0}, "placement_strategy": "STRICT_PACK"},
    ),
    "rayjob-multiturn.yaml": ("1P(TP1)1D(TP1)", None),
}


@pytest.fixture(scope="module")
def heads() -> Iterator[Callable[[dict[str, Any]], RayHead]]:
    """The Ray cluster standing in for a manifest's pods: their environment, their logical
    CPUs. Manifests of the same pod shape share one, as jobs submitted to one RayCluster do;
    another shape stops the previous cluster first (one at a time on this machine)."""
    with contextlib.ExitStack() as stack:
        current: dict[tuple, RayHead] = {}

        def head_for(document: dict[str, Any]) -> RayHead:
            num_cpus = int(sum(g.num_cpus * g.replicas for g in node_groups(document)))
            env = pod_env(document)
            key = (num_cpus, tuple(sorted(env.items())))
            if key not in current:
                stack.close()
                current.clear()
                current[key] = stack.enter_context(ray_head(num_cpus=num_cpus, env=env))
            return current[key]

        yield head_for


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in LOCAL.glob("rayjob-*.yaml")))
def test_a_local_rayjob_entrypoint_runs_through_ray_job_submit(name, heads, tmp_path):
    document = load(LOCAL / name)
    mounts = mounted(document, tmp_path)
    argv = localized(entrypoint_argv(document), mounts)
    (output,) = result_files(argv)
    assert any(output.startswith(str(folder)) for folder in mounts.values()), (
        "results are written to a volume"
    )
    runtime_env = yaml.safe_load(document["spec"]["runtimeEnvYAML"])
    head = heads(document)
    job = head.run(
        "ray",
        "job",
        "submit",
        "--address",
        head.address,
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        *argv,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    result = json.loads(Path(output).read_text())
    runs = result["policies"].values() if "policies" in result else [result]
    for run in runs:
        assert run["completed"] > 0 and run["failed"] == 0, run
    topology, prefill_resources = LAUNCHED[name]
    assert result["topology"] == topology
    if prefill_resources is not None:
        assert result["engines"]["prefill-0"]["resources"] == prefill_resources
    assert all(engine["alive"] for engine in result["engines"].values()), result["engines"]


def wait_for_application(head: RayHead, name: str) -> None:
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while True:
        applications = head.get_json("/api/serve/applications/").get("applications", {})
        status = applications.get(name, {}).get("status")
        if status == "RUNNING":
            return
        assert status != "DEPLOY_FAILED", applications[name].get("message")
        assert time.monotonic() < deadline, f"{name} not RUNNING after {DEPLOY_TIMEOUT_S} s"
        time.sleep(2)


@pytest.mark.slow
def test_the_local_rayservice_serve_config_deploys_and_answers_the_openai_client(heads, tmp_path):
    document = load(LOCAL / "rayservice.yaml")
    config = serve_config(document)
    port = free_port()
    config["http_options"] |= {"host": "127.0.0.1", "port": port}
    config_file = tmp_path / "serve-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    (app,) = config["applications"]
    api_key = pod_env(document)[API_KEYS_ENV].split(",")[0]
    head = heads(document)
    deploy = head.run("serve", "deploy", str(config_file), "--address", head.address)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    try:
        wait_for_application(head, app["name"])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key)
        messages = [{"role": "user", "content": "Hello from the manifest."}]
        answer = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert answer.choices[0].finish_reason == "length"
        # The tokens of the offline engine with the application's engine arguments.
        args = app["args"]
        offline = LLM(args["model"], **args.get("engine", {}))
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        (expected,) = offline.chat(messages, greedy)
        assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="not-the-secret"
            ).models.list()
        # Every probe of the manifest answers on the port it names.
        ports = {8000: port, 8265: head.dashboard_port, 52365: head.agent_port}
        for where, container in containers(document):
            for kind in ("readinessProbe", "livenessProbe"):
                probe = container.get(kind, {}).get("httpGet")
                if probe:
                    url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        assert reply.status == 200, (where, kind, url, reply.status)
    finally:
        head.run("serve", "shutdown", "-y", "--address", head.address)
