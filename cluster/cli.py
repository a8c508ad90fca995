"""The `hybridserve` command line.

    hybridserve generate --model tiny --prompt "hello" --max-tokens 16
    hybridserve export-tiny ./tiny-checkpoint

Every command takes `--config file.yaml` (keys as on the command line, kebab- or snake_case;
flags given on the command line win) and `--version`. Engine options are generated from
`EngineConfig`, so the CLI and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hybridserve.workers.config import EngineConfig
from hybridserve.workers.sampling_params import SamplingParams

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
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=None, help=text)
        elif typing.get_origin(kind) is tuple:
            group.add_argument(flag, type=int, nargs="*", default=None, help=text)
        else:
            group.add_argument(flag, type=kind, default=None, help=text)


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
    llm = LLM(**engine_args)
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
