"""A strict validator for Kubernetes objects against a CRD's OpenAPI v3 schema, as the API
server's structural-schema pruning would see them, except that a field the schema does not
declare is an error here instead of being dropped silently (a misspelt `rayStartParam` would
otherwise vanish on apply and the cluster come up without it).

It covers the schema keywords the KubeRay CRDs use: type, properties, additionalProperties,
required, items, enum, anyOf, pattern, min/maxLength, minimum, minItems, nullable, the int32/
int64 formats, x-kubernetes-int-or-string and x-kubernetes-preserve-unknown-fields. CEL rules
(x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# metadata.name of most kinds: an RFC 1123 subdomain.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
METADATA_FIELDS = {"name", "namespace", "labels", "annotations", "generateName"}


def crd_schema(crd_file: Path, version: str = "v1") -> tuple[str, dict[str, Any]]:
    """(kind, the openAPIV3Schema of `version`) of a CRD file."""
    crd = yaml.safe_load(crd_file.read_text())
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return crd["spec"]["names"]["kind"], served["schema"]["openAPIV3Schema"]
    raise ValueError(f"{crd_file.name} has no version {version}")


def _type_ok(value: Any, expected: str) -> bool:
    if expected == "object":
        return isinstance(value, dict)
    if expected == "array":
        return isinstance(value, list)
    if expected == "string":
        return isinstance(value, str)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    raise ValueError(f"unsupported schema type {expected!r}")


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every problem of `value` against `schema`, each naming its field path."""
    where = path or "(root)"
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: null is not allowed"]
    if schema.get("x-kubernetes-int-or-string"):
        if not (_type_ok(value, "integer") or _type_ok(value, "string")):
            return [f"{where}: expected an integer or a string, got {type(value).__name__}"]
        if isinstance(value, str) and "pattern" in schema:
            return _pattern(value, schema, where)
        return []
    if "anyOf" in schema and all(validate(value, option, path) for option in schema["anyOf"]):
        return [f"{where}: matches none of {schema['anyOf']}"]
    expected = schema.get("type")
    if expected is not None and not _type_ok(value, expected):
        return [f"{where}: expected {expected}, got {type(value).__name__} {value!r}"]
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        problems += _pattern(value, schema, where)
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            problems.append(f"{where}: longer than {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            problems.append(f"{where}: shorter than {schema['minLength']}")
    if _type_ok(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where}: {value} is below the minimum {schema['minimum']}")
        low, high = INT_RANGES.get(schema.get("format", ""), (None, None))
        if low is not None and not low <= value <= high:
            problems.append(f"{where}: {value} does not fit {schema['format']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(f"{where}: fewer than {schema['minItems']} items")
        for index, item in enumerate(value):
            problems += validate(item, schema.get("items", {}), f"{path}[{index}]")
    if isinstance(value, dict):
        problems += _object(value, schema, path)
    return problems


def _pattern(value: str, schema: dict[str, Any], where: str) -> list[str]:
    if "pattern" in schema and not re.search(schema["pattern"], value):
        return [f"{where}: {value!r} does not match {schema['pattern']}"]
    return []


def _object(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    problems = [
        f"{path or '(root)'}: missing required field {name!r}"
        for name in schema.get("required", [])
        if name not in value
    ]
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    open_ended = schema.get("x-kubernetes-preserve-unknown-fields", False)
    for name, item in value.items():
        child = f"{path}.{name}" if path else str(name)
        if name in properties:
            problems += validate(item, properties[name], child)
        elif isinstance(extra, dict):
            problems += validate(item, extra, child)
        elif not (open_ended or extra is True):
            problems.append(f"{child}: unknown field (the schema declares {sorted(properties)})")
    return problems


def validate_object(document: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """A whole object: its schema, plus the ObjectMeta fields the CRD leaves untyped."""
    # The API server types ObjectMeta itself; CRDs leave the root `metadata` an empty object.
    root = schema | {"properties": schema["properties"] | {"metadata": {"type": "object"}}}
    root["properties"]["metadata"]["x-kubernetes-preserve-unknown-fields"] = True
    problems = validate(document, root)
    metadata = document.get("metadata")
    if not isinstance(metadata, dict):
        return [*problems, "metadata: required"]
    problems += [f"metadata.{k}: unknown field" for k in metadata if k not in METADATA_FIELDS]
    name = metadata.get("name", "")
    if not (isinstance(name, str) and len(name) <= 253 and DNS_SUBDOMAIN.match(name)):
        problems.append(f"metadata.name: {name!r} is not an RFC 1123 name")
    for group in ("labels", "annotations"):
        for key, label in (metadata.get(group) or {}).items():
            if not isinstance(label, str):
                problems.append(f"metadata.{group}.{key}: values are strings, got {label!r}")
    return problems
