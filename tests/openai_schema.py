"""Validate our responses against OpenAI's own OpenAPI description.

The schemas used are a subset of shared/reference/openai-openapi.json (MIT), copied into
tests/data so that a clone without shared/ still runs the tests.

The spec is OpenAPI 3.1 but still uses 3.0's `nullable: true` in places, which JSON Schema
ignores; those are rewritten to allow null before validating.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SPEC_CANDIDATES = [
    Path(__file__).resolve().parent / "data" / "openai-openapi-subset.json",
    Path(__file__).resolve().parents[1] / "shared" / "reference" / "openai-openapi.json",
    Path(__file__).resolve().parents[2] / "shared" / "reference" / "openai-openapi.json",
]


def _allow_null(node):
    if isinstance(node, dict):
        node = {k: _allow_null(v) for k, v in node.items()}
        if node.pop("nullable", False):
            node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_allow_null(v) for v in node]
    return node


@functools.cache
def _registry() -> tuple[Registry, dict]:
    path = next((p for p in SPEC_CANDIDATES if p.exists()), None)
    if path is None:
        raise FileNotFoundError("openai-openapi.json not found in shared/reference")
    spec = _allow_null(json.loads(path.read_text()))
    resource = DRAFT202012.create_resource(spec)
    return Registry().with_resource("openai.json", resource), spec


def validator(component: str) -> Draft202012Validator:
    registry, _ = _registry()
    schema = {"$ref": f"openai.json#/components/schemas/{component}"}
    return Draft202012Validator(schema, registry=registry)


def assert_valid(component: str, instance: dict) -> None:
    errors = sorted(validator(component).iter_errors(copy.deepcopy(instance)), key=lambda e: list(e.path))
    assert not errors, f"{component} violations: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
