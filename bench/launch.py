"""What the `hybridserve bench` commands share: their target (`--base-url`, or `--launch` with
a topology) and the service they launch.

    --launch --num-prefill 1 --num-decode 1 --prefill-tp 2 --decode-tp 1 --enable-expert-parallel

With `--launch` a command starts a local Ray cluster on loopback, or joins the one at
RAY_ADDRESS (so `ray job submit -- hybridserve bench ... --launch` runs on an existing
cluster), deploys the service with that topology, and takes it down when done (on a joined
cluster only its own application). Results record the topology, TP/EP per role and the
resources every engine got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Small pools for the tiny model: a few conversations of a few thousand tokens each.
LAUNCH_ENGINE = {"max_model_len": 4096, "max_num_seqs": 16, "num_kv_blocks": 2048}


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", help="a running service, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch", action="store_true", help="start (or join) Ray and deploy the service here"
    )
    target.add_argument("--api-key", help="bearer key (also configured on --launch)")
    target.add_argument("--served-model", help="model id to send (default: GET /v1/models)")
    target.add_argument("--topology", default="unknown", help="recorded with --base-url")

    launch = parser.add_argument_group("--launch")
    launch.add_argument("--model", default="tiny", help="checkpoint to serve (default: tiny)")
    launch.add_argument(
        "--num-prefill", type=int, default=1, help="prefill engines (default: %(default)s)"
    )
    launch.add_argument(
        "--num-decode", type=int, default=1, help="decode engines (default: %(default)s)"
    )
    launch.add_argument("--prefill-tp", type=int, default=1, help="ranks per prefill engine")
    launch.add_argument(
        "--decode-tp", type=int, default=1, help="ranks per decode (or colocated) engine"
    )
    launch.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE experts partitioned over the ranks of every engine of several ranks",
    )
    launch.add_argument("--transfer-backend", choices=["tcp", "nixl"], default="tcp")
    launch.add_argument(
        "--rank-resources-json",
        help='Ray resources of each rank of a tensor-parallel engine, e.g. {"GPU": 1} '
        "(default: one GPU with GPUs, else one CPU)",
    )
    launch.add_argument("--torch-threads", type=int, default=1, help="per engine (default: 1)")
    launch.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk (default: 1)"
    )
    launch.add_argument(
        "--cpu-binding",
        choices=["auto", "off"],
        default="auto",
        help="CPU engines on cores of their own where they fit (default: auto)",
    )
    launch.add_argument(
        "--engine-json",
        help=f"EngineConfig fields as JSON, over the defaults {json.dumps(LAUNCH_ENGINE)}",
    )
    launch.add_argument("--ray-num-cpus", type=int, default=4, help="a local Ray (default: 4)")


def check_target(args: argparse.Namespace) -> None:
    if bool(args.base_url) == bool(args.launch):
        raise ValueError("give exactly one of --base-url (a running service) or --launch")
    for name in ("num_decode", "prefill_tp", "decode_tp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def launch_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ServiceConfig `--launch` deploys (validated here, before Ray starts)."""
    from hybridserve.cluster.config import ServiceConfig

    def role(tp: int) -> dict[str, Any]:
        parallel: dict[str, Any] = {"tensor_parallel_size": tp}
        if args.enable_expert_parallel and tp > 1:
            parallel["enable_expert_parallel"] = True
        return parallel if tp > 1 else {}

    engine = LAUNCH_ENGINE | {"transfer_backend": args.transfer_backend}
    config = {
        "model": args.model,
        "num_prefill": args.num_prefill,
        "num_decode": args.num_decode,
        "engine": engine | json.loads(args.engine_json or "{}"),
        "prefill_engine": role(args.prefill_tp) if args.num_prefill else {},
        "decode_engine": role(args.decode_tp),
        "torch_threads": args.torch_threads,
        "stream_interval": args.stream_interval,
        "cpu_binding": args.cpu_binding,
        "api_keys": [args.api_key] if args.api_key else [],
    }
    if args.rank_resources_json:
        config["rank_resources"] = json.loads(args.rank_resources_json)
    return ServiceConfig(**config).model_dump(mode="json")


def topology_label(args: argparse.Namespace) -> str:
    """xPyD as in vLLM's disaggregation docs, with TP per role; "yC" for colocated engines."""
    if not args.launch:
        return args.topology
    ep = "+EP" if args.enable_expert_parallel else ""
    decode = f"{args.num_decode}{'D' if args.num_prefill else 'C'}"
    decode += f"(TP{args.decode_tp}{ep if args.decode_tp > 1 else ''})"
    if not args.num_prefill:
        return decode
    return f"{args.num_prefill}P(TP{args.prefill_tp}{ep if args.prefill_tp > 1 else ''}){decode}"


@dataclass
class Target:
    base_url: str
    coordinator: Any | None  # with --launch
    config: dict[str, Any] | None  # the launched ServiceConfig

    def engines(self) -> dict[str, Any]:
        """Per engine: role, TP/EP and the resources it got (launched services only)."""
        if self.coordinator is None or self.config is None:
            return {}
        resources = self.coordinator.engine_resources.remote().result()
        topology = self.coordinator.topology.remote().result()
        described = {}
        for name, got in resources.items():
            role = "prefill" if name.startswith("prefill-") else "decode"
            if name.startswith("colocated-"):
                role = "colocated"
            engine = self.config["engine"] | (
                self.config["prefill_engine"] if role == "prefill" else self.config["decode_engine"]
            )
            described[name] = {
                "role": role,
                "tensor_parallel_size": engine.get("tensor_parallel_size", 1),
                "enable_expert_parallel": engine.get("enable_expert_parallel", False),
                "resources": got,
                "alive": name in topology["engines"],
            }
        return described


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[Target]:
    """The service a benchmark drives: the one at --base-url, or one launched for it."""
    if not args.launch:
        yield Target(args.base_url.rstrip("/"), None, None)
        return
    from hybridserve.cluster.control import local

    config = launch_config(args)
    print(f"launching the service ({topology_label(args)}) ...", file=sys.stderr)
    local.connect_ray(num_cpus=args.ray_num_cpus)
    try:
        proxy_url = local.deploy(config, port=local.free_port())
        # Where the ingress takes HTTP itself (a cluster we started), one hop fewer.
        yield Target(local.direct_url() or proxy_url, local.coordinator(), config)
    finally:
        local.shutdown()
