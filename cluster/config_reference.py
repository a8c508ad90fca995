"""The configuration reference (docs/configuration.md), generated from the fields of
`EngineConfig`, `ServiceConfig` and `RouterConfig`: their types, defaults and descriptions.

    python -m hybridserve.cluster.config_reference > docs/configuration.md

A test fails when the file is stale, so no hand-kept copy of a field table can drift from the
code.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.routing.router import RouterConfig
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.speculative.config import SpeculativeConfig

HEADER = """# Configuration

Generated from the code by `python -m hybridserve.cluster.config_reference` (a test fails when
this file is stale); do not edit it by hand.

Engine arguments are the same everywhere: keyword arguments of `LLM(...)` and `EngineConfig`,
`--kebab-case` options of `hybridserve generate`, keys of `--config file.yaml`, and the
`engine` / `prefill_engine` / `decode_engine` dicts of the service. The service's own fields
are the Serve application's `args` (`serve run`, `serve deploy`, a KubeRay RayService
`serveConfigV2`), which `hybridserve serve` builds from its options.
"""

SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    (
        "Engine (`EngineConfig`)",
        EngineConfig,
        "One engine: model, memory pools, batching, parallelism, forward paths, disaggregation.",
    ),
    (
        "Speculative decoding (`EngineConfig.speculative_config`, `SpeculativeConfig`)",
        SpeculativeConfig,
        "How a decode step guesses and verifies several tokens of each request "
        "(docs/speculative-decoding.md).",
    ),
    (
        "Service (`ServiceConfig`)",
        ServiceConfig,
        "The whole service: engines and their placement, authentication, limits, CPU threads.",
    ),
    (
        "Router (`ServiceConfig.router`, `RouterConfig`)",
        RouterConfig,
        "How the router chooses engines.",
    ),
]


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `str | None`, `'a' | 'b'`, `tuple[int, ...]`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {type_name(args[0])}"
    if origin in (dict, list, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "defaults" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default!r}`"


def section(title: str, model: type[BaseModel], summary: str) -> str:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if not field.description:
            raise ValueError(f"{model.__name__}.{name} has no description")
        meaning = field.description.replace("|", "\\|")
        rows.append(
            f"| `{name}` | {type_name(field.annotation)} | {default_text(field)} | {meaning} |"
        )
    return f"## {title}\n\n{summary}\n\n" + "\n".join(rows) + "\n"


def reference() -> str:
    return HEADER + "".join("\n" + section(*entry) for entry in SECTIONS)


if __name__ == "__main__":
    sys.stdout.write(reference())
