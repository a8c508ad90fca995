"""The `hybridserve` command line.

    hybridserve generate --model tiny --prompt "hello" --max-tokens 16
    hybridserve serve Qwen/Qwen3-Next-80B-A3B-Instruct --tensor-parallel-size 4
    hybridserve run-batch -i requests.jsonl -o results.jsonl --model tiny
    hybridserve export-tiny ./tiny-checkpoint

Every command takes `--config file.yaml` (keys as on the command line, kebab- or snake_case;
flags given on the command line win) and `--version`. Engine options are generated from
`EngineConfig`, so the CLI and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
import types
import typing
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from hybridserve.cluster.config import API_KEYS_ENV, ServiceConfig
from hybridserve.cluster.openai.tool_parsers import FORMATS
from hybridserve.cluster.routing.router import Policy
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridserve.workers import LLM

logger = logging.getLogger("hybridserve")


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; Literal stays Literal."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def add_model_options(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: Sequence[str] = ()
) -> None:
    """One `--kebab-case` option per pydantic field; unset options stay None (model default)."""
    group = parser.add_argument_group(f"{model.__name__} options")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind = _base_type(field.annotation)
        default = field.default
        text = f"{field.description or ''} (default: {default})".lstrip()
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            # A nested configuration (speculative_config): a JSON object, as vLLM takes it.
            group.add_argument(flag, type=_json_object, default=None, metavar="JSON", help=text)
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=None, help=text)
        elif typing.get_origin(kind) is tuple:
            item = typing.get_args(kind)[0]
            if typing.get_origin(item) is typing.Literal:
                choices = typing.get_args(item)
                group.add_argument(flag, choices=choices, nargs="*", default=None, help=text)
            else:
                group.add_argument(flag, type=item, nargs="*", default=None, help=text)
        else:
            group.add_argument(flag, type=kind, default=None, help=text)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('expected a JSON object, e.g. \'{"method": "ngram"}\'')
    return value


def model_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in model.model_fields
        if getattr(args, name, None) is not None
    }


def _load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    known = {a.dest for a in parser._actions}
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest in ("config", "help", "version"):
            parser.error(f"--config {path}: unknown option {key!r} for this command")
        values[dest] = value
    return values


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read options from a YAML file; command-line flags win",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: WARNING)",
    )


def build_parser() -> argparse.ArgumentParser:
    # Help strings state their own defaults: generated options default to None on the parser
    # (so that "not given" is visible) while the real default lives in the pydantic model.
    formatter = argparse.HelpFormatter
    parser = argparse.ArgumentParser(
        prog="hybridserve",
        formatter_class=formatter,
        description="Serving for hybrid Mamba/attention language models.",
    )
    parser.add_argument(
        "--version", action="version", version=f"hybridserve {version('hybridserve')}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate",
        formatter_class=formatter,
        help="generate offline in this process",
        description="Generate text for one or more prompts with an in-process engine.",
    )
    generate.add_argument(
        "--prompt", action="append", required=False, help="a prompt (repeat for several)"
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message with the chat template",
    )
    generate.add_argument(
        "--json", action="store_true", help="print one JSON object per request instead of the text"
    )
    add_model_options(generate, EngineConfig)
    # --seed is the engine seed: every request here derives its sampling seed from it.
    add_model_options(generate, SamplingParams, skip=("seed",))
    _add_common(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser(
        "serve",
        formatter_class=formatter,
        help="serve the OpenAI API from prefill + decode engines on Ray",
        description="Start a local Ray cluster on loopback (or join RAY_ADDRESS), start the "
        "engines and serve the OpenAI-compatible API until interrupted.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as vLLM's `serve MODEL`: 'tiny', a checkpoint folder or a Hugging "
        "Face id (same as --model)",
    )
    add_service_options(serve)
    add_model_options(serve, EngineConfig, skip=("role",))
    _add_common(serve)
    serve.set_defaults(handler=_serve)

    batch = commands.add_parser(
        "run-batch",
        formatter_class=formatter,
        help="run an OpenAI batch file, offline or against a running service",
        description="Run every request of an OpenAI batch file (JSON lines of custom_id, "
        "method, url, body) and write one result line each, in input order: offline through "
        "the server's routes on an engine in this process, or against --url.",
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch file (.jsonl)")
    batch.add_argument("-o", "--output-file", required=True, help="where results go (.jsonl)")
    batch.add_argument("--url", help="a running service's base URL (default: run offline)")
    batch.add_argument("--api-key", help="the service's bearer key (with --url)")
    batch.add_argument(
        "--max-concurrency", type=int, default=64, help="requests at once (default: 64)"
    )
    batch.add_argument("--chat-template", help="a chat template file (offline)")
    batch.add_argument("--tool-call-parser", default="auto", help="as for serve (offline)")
    batch.add_argument("--reasoning-parser", default="auto", help="as for serve (offline)")
    add_model_options(batch, EngineConfig, skip=("role",))
    _add_common(batch)
    batch.set_defaults(handler=_run_batch)

    bench = commands.add_parser(
        "bench", formatter_class=formatter, help="benchmarks against a running service"
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    multiturn = benchmarks.add_parser(
        "multiturn",
        formatter_class=formatter,
        help="multi-turn chat: TTFT and reuse per routing policy",
        description="Multi-turn chat conversations with shared system prompts against the "
        "service (or one it launches); TTFT and reused tokens per routing policy, against "
        "what an ideal cache could reuse.",
    )
    from hybridserve.bench import multiturn as multiturn_bench
    from hybridserve.bench import serve as serve_bench_module

    multiturn_bench.add_arguments(multiturn)
    _add_common(multiturn)
    multiturn.set_defaults(handler=lambda args, parser: multiturn_bench.run(args))
    serve_bench = benchmarks.add_parser(
        "serve",
        formatter_class=formatter,
        help="request throughput and latency, as `vllm bench serve` measures them",
        description="Random or shared-prefix prompts at a request rate (or all at once) "
        "against the service, or one it launches with a topology; vLLM bench serve's keys.",
    )
    serve_bench_module.add_arguments(serve_bench)
    _add_common(serve_bench)
    serve_bench.set_defaults(handler=lambda args, parser: serve_bench_module.run(args))

    export = commands.add_parser(
        "export-tiny",
        formatter_class=formatter,
        help="write the built-in tiny model as an HF-format checkpoint",
        description="Write the built-in tiny model (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json) to a folder.",
    )
    export.add_argument("output", help="folder to write")
    _add_common(export)
    export.set_defaults(handler=_export_tiny)
    return parser


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hybridserve.workers import LLM

    if not args.prompt:
        parser.error("generate needs at least one --prompt")
    engine_args = model_values(args, EngineConfig)
    sampling = SamplingParams(
        **{k: v for k, v in model_values(args, SamplingParams).items() if k != "seed"}
    )
    with LLM(**engine_args) as llm:
        _print_outputs(llm, args, parser, sampling)
    return 0


def _print_outputs(
    llm: LLM, args: argparse.Namespace, parser: argparse.ArgumentParser, sampling: SamplingParams
) -> None:
    prompts: list[str] = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            parser.error("--chat needs a tokenizer (this checkpoint has no tokenizer.json)")
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    for output in llm.generate(prompts, sampling):
        if args.json:
            print(
                json.dumps(
                    {
                        "request_id": output.request_id,
                        "text": output.text,
                        "token_ids": output.token_ids,
                        "prompt_token_ids": output.prompt_token_ids,
                        "finish_reason": output.finish_reason,
                        "num_cached_tokens": output.num_cached_tokens,
                    }
                )
            )
        else:
            print(output.text)


def add_service_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service options")
    group.add_argument("--num-prefill", type=int, default=1, help="prefill engines (default: 1)")
    group.add_argument("--num-decode", type=int, default=1, help="decode engines (default: 1)")
    group.add_argument(
        "--host",
        default="0.0.0.0",
        help="HTTP host; every interface by default, as vLLM's, so that a container is "
        "reachable: set --api-key, or bind 127.0.0.1 (default: 0.0.0.0)",
    )
    group.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    group.add_argument(
        "--policy",
        choices=typing.get_args(Policy),
        default="snapshot-aware",
        help="routing policy (default: snapshot-aware)",
    )
    group.add_argument(
        "--decode-prefill-threshold",
        type=int,
        default=256,
        help="a decode engine holding a conversation prefills the next turn itself when at "
        "most this many prompt tokens are uncached there (default: 256)",
    )
    group.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=[],
        help=f"accepted bearer keys (several, or repeat the flag; also {API_KEYS_ENV}); none: "
        "no authentication",
    )
    group.add_argument("--chat-template", help="a chat template file (or the template itself)")
    group.add_argument(
        "--tool-call-parser",
        default="auto",
        help=f"{', '.join(FORMATS)}; auto: read from the chat template; none: tools refused "
        "(default: auto)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve tool_choice 'auto' (default: on)",
    )
    group.add_argument(
        "--reasoning-parser",
        default="auto",
        help="think (also qwen3, deepseek_r1); auto: where the chat template writes <think>; "
        "none: off (default: auto)",
    )
    group.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="responses kept for previous_response_id per ingress replica (default: 1024)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait beyond what the decode engines run at once; more get "
        "429 with Retry-After; -1: no limit (default: 1024)",
    )
    group.add_argument("--served-model-name", help="model id for clients (default: from --model)")
    group.add_argument("--torch-threads", type=int, help="CPU threads per engine")
    group.add_argument(
        "--cpu-wait-policy",
        choices=["auto", "active", "brief", "passive"],
        default="auto",
        help="how engines' idle CPU threads wait: spin (active), sleep (passive), or spin "
        "a few tens of microseconds, then sleep (brief); auto: brief where several engines' "
        "teams of threads outnumber the cores, else active (default: auto)",
    )
    group.add_argument(
        "--cpu-binding",
        choices=["auto", "off"],
        default="auto",
        help="auto: bind each CPU engine's process to cores of its own where a node's engines "
        "fit its cores; off: the OS places their threads (default: auto)",
    )
    group.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk (first and last at once); more spares CPU per token "
        "at the price of burstier streams (default: 1)",
    )


def service_config(args: argparse.Namespace) -> dict[str, Any]:
    """A ServiceConfig dict from `serve`-style options."""
    engine = model_values(args, EngineConfig)
    model = engine.pop("model", None)
    tag = getattr(args, "model_tag", None)
    if tag is not None and model is not None and tag != model:
        raise ValueError(f"the model is given twice: {tag!r} and --model {model!r}")
    model = tag or model or "tiny"
    config: dict[str, Any] = {
        "model": model,
        "num_prefill": args.num_prefill,
        "num_decode": args.num_decode,
        "engine": engine,
        "router": {
            "policy": args.policy,
            "decode_prefill_threshold": args.decode_prefill_threshold,
        },
        "api_keys": args.api_key,
        "served_model_name": args.served_model_name,
        "torch_threads": args.torch_threads,
        "cpu_wait_policy": args.cpu_wait_policy,
        "cpu_binding": args.cpu_binding,
        "stream_interval": args.stream_interval,
        "chat_template": args.chat_template,
        "tool_call_parser": args.tool_call_parser,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "reasoning_parser": args.reasoning_parser,
        "responses_store_size": args.responses_store_size,
        "max_queued_requests": None if args.max_queued_requests < 0 else args.max_queued_requests,
    }
    return ServiceConfig(**config).model_dump()


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hybridserve.cluster.control import local

    config = service_config(args)
    local.connect_ray()
    try:
        url = local.deploy(config, host=args.host, port=args.port)
        print(f"hybridserve: serving {config['model']} at {url}/v1 (Ctrl-C to stop)", flush=True)
        direct = local.direct_url()
        if direct is not None:
            print(
                f"hybridserve: the ingress also takes requests at {direct}/v1 (no proxy hop)",
                flush=True,
            )
        # Explicitly: a shell starting us in the background leaves SIGINT ignored.
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("hybridserve: shutting down", flush=True)
    finally:
        # A second Ctrl-C must not cut the shutdown short (engines drain, actors go).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        local.shutdown()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hybridserve.cluster.run_batch import run_batch

    config = None
    if args.url is None:
        engine = model_values(args, EngineConfig)
        config = ServiceConfig(
            model=engine.pop("model", "tiny"),
            num_prefill=0,
            engine=engine,
            chat_template=args.chat_template,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    counts = run_batch(
        Path(args.input_file),
        Path(args.output_file),
        config=config,
        url=args.url,
        api_key=args.api_key,
        max_concurrency=args.max_concurrency,
        progress=sys.stderr.isatty(),
    )
    print(
        f"hybridserve run-batch: {counts['completed']} completed, {counts['failed']} failed; "
        f"results in {args.output_file}"
    )
    return 0


def _export_tiny(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hybridserve.workers.models.tiny import write_tiny_checkpoint

    print(write_tiny_checkpoint(args.output))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        subparser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
        subparser.set_defaults(**_load_config_file(args.config, subparser))
        args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args, parser)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()
        )
        print(f"hybridserve {args.command}: error: {problems}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"hybridserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
