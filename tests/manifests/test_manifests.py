"""`manifests/`, checked without a Kubernetes cluster.

- Every object validates strictly against the KubeRay CRDs (RayService, RayJob, RayCluster)
  and the built-in kinds against the core schemas those CRDs embed (Service, Pod,
  PersistentVolumeClaim); the validator rejects broken copies.
- The YAML inside: serveConfigV2 against Ray's ServeDeploySchema (unknown keys included),
  each hybridserve application's args against ServiceConfig, each RayJob's entrypoint
  against our CLI, runtimeEnvYAML against Ray's runtime_env fields.
- The arithmetic: the engines' GPUs and CPUs (ServiceConfig.resource_demand) fit the node
  groups, and containers, rayStartParams and tensor-parallel placement agree.
- Images pinned, resources requested, models from a volume, API keys from a Secret, probes on
  routes that exist.

The CRDs are read from ../shared/kuberay-crds beside the repository, or the folder in
HYBRIDSERVE_KUBERAY_CRDS; the schema tests skip, saying so, when neither exists.
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.runtime_env import RuntimeEnv
from ray.serve.schema import ServeDeploySchema

from hybridserve.bench.launch import launch_config
from hybridserve.cluster.cli import build_parser
from hybridserve.cluster.config import API_KEYS_ENV, ServiceConfig
from hybridserve.cluster.openai.routes import api
from tests.helpers import make_hf_model, save_hf_checkpoint
from tests.manifests.objects import (
    MANIFESTS,
    ROOT,
    containers,
    entrypoint_argv,
    load,
    manifest_files,
    node_groups,
    pod_specs,
    ray_pods,
    serve_config,
    service_apps,
    strict_model_problems,
)
from tests.manifests.strict_schema import crd_schema, validate, validate_object

CRDS = Path(os.environ.get("HYBRIDSERVE_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay-crds"))
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}
# The checkpoints the GPU manifests name under /models, and the family of the tiny stand-in
# the tests put there: ServiceConfig reads config.json to check the tensor-parallel split.
MODEL_FAMILIES = {"granite-4.0-h-tiny": "granitemoehybrid"}
MODELS_MOUNT = "/models"
SERVE_PORT, DASHBOARD_PORT, AGENT_PORT = 8000, 8265, 52365
NUM_SERVE_REPLICAS = 2  # the ingress and the Coordinator, one logical CPU each

FILES = manifest_files()
IDS = [str(p.relative_to(MANIFESTS)) for p in FILES]
DOCS = {str(p.relative_to(MANIFESTS)): load(p) for p in FILES}


def of_kind(*kinds: str) -> list[str]:
    return [name for name, doc in DOCS.items() if doc["kind"] in kinds]


# The manifests that run pods (the volume claims and the Secret run none).
WITH_PODS = [name for name in IDS if any(True for _ in pod_specs(DOCS[name]))]


# ---- schemas ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict[str, Any]]:
    """Kind -> the strict schema of a whole object of that kind."""
    if not CRDS.is_dir():
        pytest.skip(f"no KubeRay CRDs at {CRDS} (set HYBRIDSERVE_KUBERAY_CRDS)")
    by_kind = {kind: crd_schema(CRDS / name)[1] for kind, name in CRD_FILES.items()}
    cluster = by_kind["RayCluster"]["properties"]["spec"]["properties"]
    template = cluster["headGroupSpec"]["properties"]["template"]["properties"]
    volume = template["spec"]["properties"]["volumes"]["items"]["properties"]
    claim = volume["ephemeral"]["properties"]["volumeClaimTemplate"]["properties"]
    service = by_kind["RayService"]["properties"]["spec"]["properties"]["serveService"]

    def core(kind_spec: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["apiVersion", "kind", "metadata", *required],
            "properties": {
                "apiVersion": {"type": "string", "enum": ["v1"]},
                "kind": {"type": "string"},
                "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "spec": kind_spec,
            },
        }

    by_kind["Service"] = core(service["properties"]["spec"], ["spec"])
    by_kind["Pod"] = core(template["spec"], ["spec"])
    by_kind["PersistentVolumeClaim"] = core(claim["spec"], ["spec"])
    by_kind["Secret"] = {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata"],
        "properties": {
            "apiVersion": {"type": "string", "enum": ["v1"]},
            "kind": {"type": "string"},
            "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "type": {"type": "string"},
            "immutable": {"type": "boolean"},
            "data": {"type": "object", "additionalProperties": {"type": "string"}},
            "stringData": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    return by_kind


def test_manifests_exist_for_every_kind_on_gpus_and_on_cpus():
    kinds = {(name.startswith("local/"), doc["kind"]) for name, doc in DOCS.items()}
    for local in (False, True):
        assert {(local, kind) for kind in CRD_FILES} <= kinds
    assert (MANIFESTS / "Containerfile").is_file() and (MANIFESTS / "README.md").is_file()


@pytest.mark.parametrize("name", IDS)
def test_every_object_passes_its_schema_strictly(name, schemas):
    document = DOCS[name]
    if document["kind"] in CRD_FILES:
        assert document["apiVersion"] == "ray.io/v1"
    problems = validate_object(document, schemas[document["kind"]])
    assert not problems, "\n".join(problems)


def _broken(name: str, edit) -> dict[str, Any]:
    document = copy.deepcopy(DOCS[name])
    edit(document)
    return document


BROKEN = {
    "a misspelt field": (
        "rayservice.yaml",
        lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(
            rayStartParam={"num-gpus": "4"}
        ),
        r"workerGroupSpecs\[0\]\.rayStartParam: unknown field",
    ),
    "a number where Kubernetes wants a string": (
        "raycluster.yaml",
        lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-gpus": 8}),
        r"rayStartParams\.num-gpus: expected string",
    ),
    "a string where Kubernetes wants an integer": (
        "rayjob-bench.yaml",
        lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(maxReplicas="1"),
        r"maxReplicas: expected integer",
    ),
    "a misspelt field deep in a pod": (
        "local/rayservice.yaml",
        lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][
            0
        ]["ports"][0].update(containerPrt=6379),
        r"containers\[0\]\.ports\[0\]\.containerPrt: unknown field",
    ),
    "a missing required field": (
        "local/raycluster.yaml",
        lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"),
        r"workerGroupSpecs\[0\]: missing required field 'groupName'",
    ),
    "a bad quantity": (
        "pvc-models.yaml",
        lambda d: d["spec"]["resources"]["requests"].update(storage="200 gigabytes"),
        r"requests\.storage: '200 gigabytes' does not match",
    ),
    "a number in a Secret": (
        "secret-api-keys.yaml",
        lambda d: d["stringData"].update({"api-keys": 42}),
        r"stringData\.api-keys: expected string",
    ),
    "a Service port as text": (
        "local/rayservice.yaml",
        lambda d: d["spec"]["serveService"]["spec"]["ports"][0].update(port="8000"),
        r"ports\[0\]\.port: expected integer",
    ),
    "an invalid name": (
        "results-reader.yaml",
        lambda d: d["metadata"].update(name="Results_Reader"),
        r"metadata\.name: 'Results_Reader' is not an RFC 1123 name",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_the_validator_rejects_a_broken_copy(case, schemas):
    name, edit, shown = BROKEN[case]
    assert not validate_object(DOCS[name], schemas[DOCS[name]["kind"]])  # the intact one passes
    broken = _broken(name, edit)
    problems = validate_object(broken, schemas[broken["kind"]])
    assert any(re.search(shown, p) for p in problems), problems


def test_the_validator_reads_the_int_or_string_and_open_ended_schema_keywords():
    int_or_string = {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+%?$"}
    assert not validate(8080, int_or_string) and not validate("50%", int_or_string)
    assert validate("half", int_or_string) and validate(1.5, int_or_string)
    open_ended = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert not validate({"anything": [1, {"goes": True}]}, open_ended)
    assert validate({"a": True}, {"type": "object", "properties": {"a": {"type": "integer"}}})


# ---- the YAML inside: Serve config, app args, entrypoints, runtime envs ------------------


@pytest.fixture(scope="module")
def models_volume(tmp_path_factory) -> Path:
    """The models volume as the GPU manifests expect it, with a tiny checkpoint of the same
    family in each model folder."""
    root = tmp_path_factory.mktemp("models")
    for folder, family in MODEL_FAMILIES.items():
        save_hf_checkpoint(make_hf_model(family), root / folder)
    return root


def localized(value: Any, models_volume: Path) -> Any:
    """`value` with the models mount path pointing at the test's volume."""
    if isinstance(value, str):
        return value.replace(f"{MODELS_MOUNT}/", f"{models_volume}/")
    if isinstance(value, list):
        return [localized(v, models_volume) for v in value]
    if isinstance(value, dict):
        return {k: localized(v, models_volume) for k, v in value.items()}
    return value


def job_args(name: str, models_volume: Path):
    argv = localized(entrypoint_argv(DOCS[name]), models_volume)
    assert argv[:2] == ["hybridserve", "bench"], argv
    return build_parser().parse_args(argv[1:])


def services(name: str, models_volume: Path) -> list[ServiceConfig]:
    """The ServiceConfig of every hybridserve workload of a manifest."""
    document = DOCS[name]
    if document["kind"] == "RayService":
        apps = service_apps(document)
        return [ServiceConfig(**localized(app["args"], models_volume)) for app in apps]
    if document["kind"] == "RayJob":
        return [ServiceConfig(**launch_config(job_args(name, models_volume)))]
    return []


@pytest.mark.parametrize("name", of_kind("RayService"))
def test_serve_config_v2_is_a_strict_serve_deploy_schema_with_service_config_args(
    name, models_volume
):
    config = serve_config(DOCS[name])
    ServeDeploySchema.model_validate(config)
    assert not strict_model_problems(ServeDeploySchema, config)
    (app,) = service_apps(DOCS[name])
    assert "api_keys" not in app["args"], "API keys come from a Secret, never inline"
    (service,) = services(name, models_volume)
    assert service.num_prefill >= 1 and service.num_decode >= 1, "separate prefill and decode"


def test_strict_serve_schema_checking_finds_an_ignored_key():
    config = serve_config(DOCS["rayservice.yaml"])
    config["applications"][0]["rout_prefix"] = "/"
    config["http_options"]["prt"] = 1
    ServeDeploySchema.model_validate(config)  # what Ray itself accepts
    problems = strict_model_problems(ServeDeploySchema, config)
    assert any(p.startswith("applications[0].rout_prefix") for p in problems)
    assert any(p.startswith("http_options.prt") for p in problems)


def test_service_config_refuses_a_broken_app(models_volume):
    (app,) = service_apps(DOCS["rayservice.yaml"])
    args = localized(app["args"], models_volume) | {"num_decoders": 2}
    with pytest.raises(ValueError, match="num_decoders"):
        ServiceConfig(**args)
    # A split the model cannot take is refused from config.json alone.
    args = localized(app["args"], models_volume) | {"prefill_engine": {"tensor_parallel_size": 3}}
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split"):
        ServiceConfig(**args)


@pytest.mark.parametrize("name", of_kind("RayJob"))
def test_job_entrypoints_are_hybridserve_benchmarks_of_a_valid_service(name, models_volume):
    args = job_args(name, models_volume)
    assert args.command == "bench" and args.launch
    (service,) = services(name, models_volume)
    assert service.model == "tiny" or service.model.startswith(str(models_volume))
    runtime_env = yaml.safe_load(DOCS[name]["spec"]["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict)
    assert set(runtime_env) <= RuntimeEnv.known_fields, set(runtime_env) - RuntimeEnv.known_fields
    RuntimeEnv(**runtime_env)
    document = DOCS[name]["spec"]
    assert document["shutdownAfterJobFinishes"] is True
    assert document["ttlSecondsAfterFinished"] > 0 and document["activeDeadlineSeconds"] > 0


def test_an_entrypoint_with_a_bad_flag_is_refused():
    argv = [*entrypoint_argv(DOCS["rayjob-bench.yaml"]), "--prefil-tp", "2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv[1:])


# ---- resources: GPUs, CPUs, tensor-parallel placement ------------------------------------


def workload_names() -> list[str]:
    return of_kind("RayService", "RayJob")


@pytest.mark.parametrize("name", of_kind("RayService", "RayJob", "RayCluster"))
def test_gpu_counts_agree_between_containers_and_ray(name):
    for group in node_groups(DOCS[name]):
        assert group.num_gpus == group.container_gpus, group
    for where, container in containers(DOCS[name]):
        resources = container["resources"]
        limit = resources.get("limits", {}).get("nvidia.com/gpu")
        # Kubernetes requires extended resources' requests to equal their limits.
        assert resources["requests"].get("nvidia.com/gpu", limit) == limit, where


def fit_problems(document: dict[str, Any], service: ServiceConfig) -> list[str]:
    """How the service's engines do not fit the cluster of `document`."""
    groups = node_groups(document)
    problems = [
        f"group {g.name}: rayStartParams num-gpus {g.num_gpus} but the container has "
        f"{g.container_gpus}"
        for g in groups
        if g.num_gpus != g.container_gpus
    ]
    cluster_gpus = sum(g.num_gpus * g.replicas for g in groups)
    demand = service.resource_demand(cluster_gpus)
    bundles = [b for ranks in demand.values() for b in ranks]
    needed_gpus = sum(b.get("GPU", 0) for b in bundles)
    needed_cpus = NUM_SERVE_REPLICAS + sum(b.get("CPU", 0) for b in bundles)
    provided_cpus = sum(g.num_cpus * g.replicas for g in groups)
    if needed_gpus > cluster_gpus:
        problems.append(f"the engines need {needed_gpus:g} GPUs, the cluster has {cluster_gpus}")
    if needed_cpus > provided_cpus:
        problems.append(f"{needed_cpus:g} logical CPUs needed, {provided_cpus:g} provided")
    # An engine of several ranks is one placement group: STRICT_PACK puts it on one node.
    largest = max(g.num_gpus for g in groups)
    for engine, ranks in demand.items():
        engine_gpus = sum(b.get("GPU", 0) for b in ranks)
        if service.placement_strategy == "STRICT_PACK" and engine_gpus > largest:
            problems.append(
                f"{engine} needs {engine_gpus:g} GPUs on one node, nodes have {largest}"
            )
        if engine_gpus and any(b.get("GPU", 0) != 1 for b in ranks):
            problems.append(f"{engine}: a rank takes exactly one GPU")
    return problems


@pytest.mark.parametrize("name", workload_names())
def test_the_engines_fit_the_node_groups(name, models_volume):
    (service,) = services(name, models_volume)
    assert not fit_problems(DOCS[name], service)
    cluster_gpus = sum(g.num_gpus * g.replicas for g in node_groups(DOCS[name]))
    ranks = [b for r in service.resource_demand(cluster_gpus).values() for b in r]
    # The GPU manifests put every rank on a GPU of its own, the CPU variants none.
    expected_gpus = 0 if name.startswith("local/") else 1
    assert all(b.get("GPU", 0) == expected_gpus for b in ranks), ranks


def test_a_manifest_runs_an_engine_of_several_ranks_and_one_with_expert_parallelism(
    models_volume,
):
    configs = [c for name in workload_names() for c in services(name, models_volume)]
    gpu_configs = [c for c in configs if c.model != "tiny"]
    tp_sizes = {c.engine_config(r).tensor_parallel_size for c in gpu_configs for r in c.roles()}
    assert max(tp_sizes) > 1
    assert any(c.engine_config(r).enable_expert_parallel for c in gpu_configs for r in c.roles())


def test_the_arithmetic_catches_too_few_gpus_disagreeing_counts_and_a_split_engine(
    models_volume,
):
    (service,) = services("rayjob-bench.yaml", models_volume)  # 1 x TP 2 + 1 x TP 4
    document = copy.deepcopy(DOCS["rayjob-bench.yaml"])
    group = document["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["rayStartParams"]["num-gpus"] = "4"
    problems = fit_problems(document, service)
    assert "the engines need 6 GPUs, the cluster has 4" in problems
    assert "group gpu: rayStartParams num-gpus 4 but the container has 8" in problems
    # Four nodes of 2 GPUs hold 8, but none holds the 4 ranks of the decode engine.
    group["rayStartParams"]["num-gpus"] = "2"
    group["replicas"] = group["maxReplicas"] = 4
    for key in ("requests", "limits"):
        group["template"]["spec"]["containers"][0]["resources"][key]["nvidia.com/gpu"] = "2"
    assert fit_problems(document, service) == ["decode-0 needs 4 GPUs on one node, nodes have 2"]


# ---- images, requests, volumes, secrets, probes ------------------------------------------


def our_version() -> str:
    return importlib.metadata.version("hybridserve")


@pytest.mark.parametrize("name", WITH_PODS)
def test_images_are_pinned_and_every_container_requests_resources(name):
    assert list(containers(DOCS[name]))
    for where, container in containers(DOCS[name]):
        image = container["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag and tag not in ("", "latest"), f"{where}: {image}"
        if repository.endswith("/hybridserve"):
            flavour = "cpu" if name.startswith("local/") else "gpu"
            assert tag == f"{our_version()}-{flavour}", f"{where}: {image}"
        requests = container.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{where}: no cpu/memory requests"
    for document in (DOCS[name],):
        for field in ("rayClusterConfig", "rayClusterSpec"):
            cluster = document.get("spec", {}).get(field)
            if cluster:
                assert cluster["rayVersion"] == ray.__version__


def test_the_containerfile_builds_on_the_pinned_ray_image_with_setup_sh():
    text = (MANIFESTS / "Containerfile").read_text()
    bases = re.findall(r"rayproject/ray:(\S+)", text)
    assert bases and all(b.startswith(f"{ray.__version__}-") for b in bases), bases
    assert "./setup.sh" in text and "latest" not in text


def workload_model(name: str) -> str:
    document = DOCS[name]
    if document["kind"] == "RayService":
        return service_apps(document)[0]["args"]["model"]
    return build_parser().parse_args(entrypoint_argv(document)[1:]).model


@pytest.mark.parametrize("name", [n for n in workload_names() if not n.startswith("local/")])
def test_models_come_from_the_read_only_volume_on_every_ray_pod(name):
    model = workload_model(name)
    assert model.startswith(f"{MODELS_MOUNT}/") and Path(model).name in MODEL_FAMILIES
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for pod in ray_pods(DOCS[name])
        for v in pod.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    for pod in ray_pods(DOCS[name]):
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[MODELS_MOUNT].get("readOnly") is True
        assert claims[mounts[MODELS_MOUNT]["name"]] == DOCS["pvc-models.yaml"]["metadata"]["name"]


@pytest.mark.parametrize("name", [n for n in workload_names() if n.startswith("local/")])
def test_the_local_workloads_run_the_built_in_model_and_mount_no_models_volume(name):
    """The CPU variants run where no volume of checkpoints exists (tests/manifests/
    test_local.py runs them)."""
    assert workload_model(name) == "tiny"
    for pod in ray_pods(DOCS[name]):
        mounts = [m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])]
        assert MODELS_MOUNT not in mounts


@pytest.mark.parametrize("name", WITH_PODS)
def test_volumes_and_secrets_refer_to_objects_the_manifests_define(name):
    defined = {(d["kind"], d["metadata"]["name"]): d for d in DOCS.values()}
    assert list(pod_specs(DOCS[name]))
    for where, pod in pod_specs(DOCS[name]):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in defined, f"{where}: {claim}"
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mounts undeclared {mount['name']}"
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = defined[("Secret", ref["name"])]
                    assert ref["key"] in secret.get("stringData", secret.get("data", {}))


@pytest.mark.parametrize("name", of_kind("RayService"))
def test_every_pod_of_a_service_reads_the_api_keys_from_the_secret(name):
    for pod in ray_pods(DOCS[name]):
        env = {v["name"]: v for v in pod["containers"][0].get("env", [])}
        assert "secretKeyRef" in env[API_KEYS_ENV]["valueFrom"]


def http_probes(document: dict[str, Any]) -> list[tuple[int, str]]:
    probes = []
    for _, container in containers(document):
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            http = container.get(kind, {}).get("httpGet")
            if http:
                probes.append((http["port"], http["path"]))
    return probes


@pytest.mark.parametrize("name", of_kind("RayService"))
def test_service_probes_use_the_ingress_health_route(name):
    routes = set(api.openapi()["paths"])  # the ingress's routes
    probes = http_probes(DOCS[name])
    assert (SERVE_PORT, "/health") in probes
    for port, path in probes:
        assert port in (SERVE_PORT, DASHBOARD_PORT, AGENT_PORT), (port, path)
        if port == SERVE_PORT:
            assert path in routes, path
    # KubeRay deploys Serve apps only once the head is Ready: its probes cannot need them.
    head = DOCS[name]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    for kind in ("readinessProbe", "livenessProbe"):
        assert head["containers"][0][kind]["httpGet"]["port"] != SERVE_PORT
