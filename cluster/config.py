"""ServiceConfig: the whole service in one validated model.

The same dict is the Ray Serve application's `args` (`serve run`, `serve deploy`, a KubeRay
RayService `serveConfigV2`) and what `hybridserve serve` builds from its flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hybridserve.cluster.openai.reasoning_parsers import REASONING_PARSERS
from hybridserve.cluster.openai.tool_parsers import FORMATS
from hybridserve.cluster.routing.router import RouterConfig
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.models.hub import is_repo_id

API_KEYS_ENV = "HYBRIDSERVE_API_KEYS"
Role = Literal["prefill", "decode", "colocated"]
# libgomp (torch's OpenMP on Linux) spins this many times (a `pause` each, ~12 ns on the
# benchmark VM: ~25 us) before a waiting thread sleeps, where cpu_wait_policy is "brief". Most
# gaps between a step's parallel regions are microseconds of Python and dispatch; the other
# engine's work on a shared core lasts milliseconds. Its default, 300000, spans both.
BRIEF_SPIN_COUNT = 2000
# The variables that set how OpenMP threads wait: an operator who set either has chosen.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# What each cpu_wait_policy puts in the engines' environment ("active": OpenMP's default).
WAIT_ENV = {
    "active": {},
    "brief": {"GOMP_SPINCOUNT": str(BRIEF_SPIN_COUNT)},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
LIBGOMP_DEFAULT_SPIN_COUNT = 300_000
SPIN_COUNT_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def cpu_wait(env: Mapping[str, str]) -> str:
    """How OpenMP threads started with `env` wait: "passive", "brief" or "active". A
    GOMP_SPINCOUNT that libgomp can read sets the spin whatever OMP_WAIT_POLICY says."""
    spins = _spin_count(env.get("GOMP_SPINCOUNT", ""))
    if spins is not None:
        if spins == 0:
            return "passive"
        return "brief" if spins < LIBGOMP_DEFAULT_SPIN_COUNT else "active"
    return "passive" if env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE" else "active"


def _spin_count(text: str) -> float | None:
    """GOMP_SPINCOUNT as libgomp reads it (a count with an optional k, M, G or T, or
    "infinite"), or None where it is unset or unreadable (libgomp ignores it then)."""
    text = text.strip().lower()
    if text in ("infinite", "infinity"):
        return float("inf")
    multiplier = SPIN_COUNT_UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SPIN_COUNT_UNITS else text
    return int(digits) * multiplier if digits.isdigit() else None


class ServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        "tiny", description="'tiny', an HF-format checkpoint folder or a Hugging Face id"
    )
    served_model_name: str | None = Field(
        None, description="the model id clients send; default: 'tiny' or the folder name"
    )
    num_prefill: int = Field(
        1, ge=0, description="prefill engines (0: decode engines run whole requests)"
    )
    num_decode: int = Field(1, ge=1, description="decode engines")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig fields for every engine"
    )
    prefill_engine: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig overrides for prefill engines"
    )
    decode_engine: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig overrides for decode engines"
    )
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="how engines are chosen (RouterConfig, below)"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description=f"accepted bearer keys (also {API_KEYS_ENV}, comma-separated); "
        "empty: no authentication",
    )
    tenants: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant: tenants never share cached prefixes (a key not "
        "listed is its own tenant)",
    )
    metrics_require_api_key: bool = Field(
        False,
        description="whether GET /metrics needs one of api_keys; off by default, as in vLLM: "
        "Prometheus scrapers carry no key, and the page holds counts, not content",
    )
    chat_template: str | None = Field(
        None,
        description="a chat template (a file, or the template itself) instead of the "
        "checkpoint's own",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="whether a request may bring its own chat_template (as vLLM's flag: a "
        "template is code the server runs, and an endless loop in one stalls the ingress)",
    )
    tool_call_parser: str = Field(
        "auto",
        description=f"how tool calls are read from the output: {', '.join(FORMATS)}; 'auto': "
        "the one format the chat template writes; 'none': tools refused",
    )
    enable_auto_tool_choice: bool = Field(
        True, description="whether tool_choice 'auto' (the default with tools) is served"
    )
    reasoning_parser: str = Field(
        "auto",
        description="how reasoning is split from the answer: think (also named qwen3, "
        "deepseek_r1); 'auto': think where the chat template writes <think>; 'none': off",
    )
    responses_store_size: int = Field(
        1024,
        ge=0,
        description="responses each ingress replica keeps for previous_response_id (oldest "
        "dropped first; 0: none kept)",
    )
    engine_actor_options: dict[str, Any] | None = Field(
        None,
        description="Ray actor options of each engine of one rank; default {'num_cpus': 0}, "
        "plus {'num_gpus': 1} on a GPU engine; an engine of several ranks takes "
        "`rank_resources` per rank instead",
    )
    rank_resources: dict[str, float] | None = Field(
        None,
        description="resources of each rank of a tensor-parallel engine (one placement group "
        "bundle); default {'GPU': 1} on a GPU engine, else {'CPU': 1}",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="how a tensor-parallel engine's bundles are placed (STRICT_PACK: one node)",
    )
    placement_check: Literal["now", "wait"] = Field(
        "now",
        description="now: an engine the cluster's nodes cannot hold even when empty is refused "
        "at start, naming what it asks and what the nodes have; wait: wait "
        "placement_timeout_s for nodes to join (a cluster that autoscales)",
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long a tensor-parallel engine waits for its bundles when the cluster "
        "has the resources but they are taken",
    )
    torch_threads: int | dict[Role, int] | None = Field(
        None,
        description="CPU threads per engine, for every role or per role ({'prefill': 2, "
        "'decode': 1}; a role left out gets torch's choice, which in an engine actor is Ray's "
        "OMP_NUM_THREADS: the actor's whole CPUs, at least 1); default: torch's choice",
    )
    cpu_wait_policy: Literal["auto", "active", "brief", "passive"] = Field(
        "auto",
        description="how an engine's idle CPU threads wait for their next parallel region: "
        "'active' spins (OpenMP's default: fastest while each thread has a core of its own), "
        "'passive' sleeps at once (OMP_WAIT_POLICY=PASSIVE), 'brief' spins a few tens of "
        "microseconds, then sleeps (GOMP_SPINCOUNT): long enough for the gap between a "
        "step's parallel regions, too short to hold a core another engine's threads need; "
        "'auto': brief exactly where two or more engine ranks run several threads each and "
        "the CPU engines' threads outnumber the cores of the Coordinator's node, else active",
    )
    cpu_binding: Literal["auto", "off"] = Field(
        "auto",
        description="'auto': on each node where its CPU engines' threads fit its cores, bind "
        "each engine's compute (its stepping thread and OpenMP team) to cores of its own "
        "(consecutive, in engine order), so that two engines' steps never take turns on a "
        "core; where they do not fit, or a tensor-parallel CPU engine runs there, the node's "
        "engines stay unbound. Other threads and processes are never bound. 'off': the OS "
        "places every thread",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens per streamed chunk: a choice's new tokens go out once there are "
        "this many (its first and last at once); more spares the CPU each chunk costs, at the "
        "price of burstier streams",
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="the longest a transfer waits for its peer's next bytes"
    )
    transfer_deadline_s: float = Field(
        60.0,
        gt=0,
        description="the longest one KV/state transfer takes from request to ack (a peer "
        "that trickles bytes cannot hold a transfer open past it)",
    )
    transfer_host: str | None = Field(
        None,
        description="the address engines' transfer endpoints (decode) and the engines' and "
        "router's feeds bind and advertise; default: each actor's own node address (Ray's "
        "node IP)",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on shutdown, how long running requests may finish"
    )
    max_request_bytes: int = Field(8 << 20, ge=1024, description="larger bodies get 413")
    engine_stall_timeout_s: float = Field(
        10.0,
        gt=0,
        description="an engine whose stepping loop has not come round for this long is "
        "wedged: /health turns 503 (if no other decode engine serves) and it leaves routing",
    )
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="a request still running this long after it arrived ends with a 504 "
        "(an error event in a stream) and is aborted on every engine; None: no deadline",
    )
    max_engine_restarts: int = Field(
        3, ge=0, description="how often the Coordinator restarts an engine that died or wedged"
    )
    engine_restart_backoff_s: float = Field(
        1.0, ge=0, description="the wait before an engine's first restart; doubles per attempt"
    )
    max_queued_requests: int | None = Field(
        1024,
        ge=0,
        description="requests that may wait beyond what the decode engines run at once "
        "(max_num_seqs each); more get 429 with Retry-After; None: no limit",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_is_readable(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
        return path.read_text()

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str, info: ValidationInfo) -> str:
        known = FORMATS if info.field_name == "tool_call_parser" else REASONING_PARSERS
        if value not in ("auto", "none", *known):
            raise ValueError(
                f"{info.field_name} {value!r} is not one of auto, none, {', '.join(known)}"
            )
        return value

    @field_validator("engine", "prefill_engine", "decode_engine")
    @classmethod
    def _no_reserved_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = {"model", "role"} & set(value)
        if reserved:
            raise ValueError(
                f"{sorted(reserved)} are set by the service (use `model` and "
                "num_prefill / num_decode), not per engine"
            )
        return value

    @field_validator("torch_threads")
    @classmethod
    def _threads_are_positive(
        cls, value: int | dict[Role, int] | None
    ) -> int | dict[Role, int] | None:
        counts = value.values() if isinstance(value, dict) else [value]
        if any(count is not None and count < 1 for count in counts):
            raise ValueError(f"torch_threads: {value!r}; thread counts are at least 1")
        return value

    @model_validator(mode="after")
    def _engines_are_valid(self) -> ServiceConfig:
        for role in self.roles():
            try:
                self.engine_config(role)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
                )
                raise ValueError(f"{role} engine configuration: {problems}") from None
        return self

    def roles(self) -> list[Role]:
        return ["prefill", "decode"] if self.num_prefill else ["colocated"]

    def engine_config(self, role: Role) -> EngineConfig:
        """One role's EngineConfig: shared fields, then the role's overrides. Decode engines
        commit a turn-end snapshot by default: the next turn of their conversation resumes
        there."""
        overrides = self.prefill_engine if role == "prefill" else self.decode_engine
        defaults: dict[str, Any] = {} if role == "prefill" else {"snapshot_turn_end": True}
        fields = defaults | self.engine | overrides
        decode_spec = (self.engine | self.decode_engine).get("speculative_config") or {}
        if isinstance(decode_spec, BaseModel):
            decode_spec = decode_spec.model_dump()
        if role == "prefill" and decode_spec.get("method") == "mtp":
            # Decode engines guessing with MTP layers need their KV over the prompt, and
            # their first guesses, from the prefill engine: it runs them too.
            fields["speculative_config"] = decode_spec
        if fields.get("tensor_parallel_size", 1) > 1:
            # The service's engines span rank actors (cluster/control/rank_actors.py).
            fields.setdefault("distributed_executor_backend", "ray")
        return EngineConfig(**fields, model=self.model, role=role)

    def threads(self, role: Role) -> int | None:
        """CPU threads of a `role` engine (None: torch's choice). On a small machine the
        roles want different counts: a prefill engine runs alone between prompts and takes
        every core, a decode engine shares its cores with the HTTP path every token."""
        if isinstance(self.torch_threads, dict):
            return self.torch_threads.get(role)
        return self.torch_threads

    def cpu_engine_threads(self, cluster_gpus: float) -> list[int]:
        """The CPU threads of each rank of every CPU engine. Where `torch_threads` leaves it
        to torch, Ray's OMP_NUM_THREADS: the rank's whole CPUs, at least 1."""
        return [
            self.threads(role) or max(1, int(self.rank_bundle(role, cluster_gpus).get("CPU", 0)))
            for role in self.engine_names().values()
            if not self.on_gpu(role, cluster_gpus)
            for _ in range(self.engine_config(role).tensor_parallel_size)
        ]

    def teams_share_cores(self, num_cores: int, cluster_gpus: float) -> bool:
        """Whether CPU engine ranks with teams of threads (more than one each) are two or
        more, and the CPU engines' threads together outnumber `num_cores`. Each team's waits
        would then spin on cores another's threads need: libgomp cuts its spin short only
        where its own process holds more threads than cores."""
        threads = self.cpu_engine_threads(cluster_gpus)
        return sum(threads) > num_cores and sum(count > 1 for count in threads) >= 2

    def engine_env(
        self, num_cores: int, cluster_gpus: float, inherited: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment variables of the engine actors (and their ranks) where `num_cores`
        cores take every engine and they inherit `inherited`: how their threads wait
        (`cpu_wait_policy`), unless `inherited` says so already (an operator's choice). On 2
        cores, 1 prefill + 1 decode engine of 2 threads each: 32 streams without pause got
        26% of the offline engine's output tok/s spinning, 56% sleeping, 53% spinning
        briefly; a lone stream's first token came 10, 28 and 18 ms after the offline
        engine's. With one team (prefill 2 threads, decode 1) spinning costs little (427
        against 464 tok/s sleeping), so `auto` leaves it spinning."""
        if any((inherited or {}).get(name) for name in WAIT_VARIABLES):
            return {}
        policy = self.cpu_wait_policy
        if policy == "auto":
            policy = "brief" if self.teams_share_cores(num_cores, cluster_gpus) else "active"
        return dict(WAIT_ENV[policy])

    def inherited_env(self, node_env: Mapping[str, str]) -> dict[str, str]:
        """What an engine actor's environment holds before the Coordinator adds to it: the
        node's (`node_env`, the Coordinator's own), then `engine_actor_options`' variables."""
        options = self.engine_actor_options or {}
        return dict(node_env) | dict((options.get("runtime_env") or {}).get("env_vars") or {})

    def on_gpu(self, role: Role, cluster_gpus: float) -> bool:
        """Whether `role`'s engines run on GPUs on a cluster with `cluster_gpus` in all."""
        device = self.engine_config(role).device
        return device == "cuda" or (device == "auto" and cluster_gpus > 0)

    def single_rank_options(self, role: Role, cluster_gpus: float) -> dict[str, Any]:
        """Ray actor options of a `role` engine of one rank."""
        if self.engine_actor_options is not None:
            return dict(self.engine_actor_options)
        options: dict[str, Any] = {"num_cpus": 0}
        if self.on_gpu(role, cluster_gpus):
            options["num_gpus"] = 1
        return options

    def rank_bundle(self, role: Role, cluster_gpus: float) -> dict[str, float]:
        """The Ray resources one rank of a `role` engine takes: its placement group bundle,
        or an engine of one rank's actor options in bundle form. The Coordinator places
        engines by it; deployments size their nodes by `resource_demand`."""
        if self.engine_config(role).tensor_parallel_size == 1:
            options = self.single_rank_options(role, cluster_gpus)
            bundle = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0)}
            bundle |= options.get("resources", {})
            return {name: float(amount) for name, amount in bundle.items() if amount}
        if self.rank_resources is not None:
            return dict(self.rank_resources)
        return {"GPU": 1.0} if self.on_gpu(role, cluster_gpus) else {"CPU": 1.0}

    def resource_demand(self, cluster_gpus: float) -> dict[str, list[dict[str, float]]]:
        """Engine name -> one bundle per rank, what the engines of this service take on a
        cluster with `cluster_gpus` GPUs (the Serve replicas take one CPU each besides)."""
        return {
            name: [self.rank_bundle(role, cluster_gpus)]
            * self.engine_config(role).tensor_parallel_size
            for name, role in self.engine_names().items()
        }

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == "tiny" or is_repo_id(self.model):
            return self.model  # a Hugging Face id is its own name, as vLLM serves it
        return Path(self.model).name

    def accepted_keys(self) -> list[str]:
        from_env = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        return [*self.api_keys, *from_env]

    def engine_names(self) -> dict[str, Role]:
        """Engine name -> role, in a stable order."""
        if not self.num_prefill:
            return {f"colocated-{i}": "colocated" for i in range(self.num_decode)}
        names: dict[str, Role] = {f"prefill-{i}": "prefill" for i in range(self.num_prefill)}
        names.update({f"decode-{i}": "decode" for i in range(self.num_decode)})
        return names
