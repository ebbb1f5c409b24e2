"""Fuzzing the API from its own OpenAPI description: no input makes the server fail.

schemathesis generates requests for every route from the app's OpenAPI (valid ones, and ones
that break the schema), a fixed number per route, derandomized so a run is repeatable; each is
sent to a real server (scripted engine, judge on) with a valid key. Any 5xx, or a connection the
server drops, fails the test.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from nextstate.app import create_app
from nextstate.core.settings import Settings
from tests.conftest import scripted_factory



def openapi() -> dict:
    """The app's own OpenAPI, narrowed where the JSON schema cannot say what the checks behind it
    refuse (the served model's name, a content per role, text-only options), so that requests
    the generator calls valid get through the whole turn path and are answered 200."""
    document = create_app(Settings(learn=False)).openapi()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    props["model"] = {"type": "string", "enum": ["tiny"]}
    props["messages"] = {
        "type": "array", "minItems": 1, "maxItems": 4,
        "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "user", "assistant", "developer"]}, "content": {"type": "string"}},
        },
    }
    for name in ("response_format", "logit_bias", "tools", "tool_choice", "n", "top_logprobs"):
        props.pop(name, None)
    for name in ("presence_penalty", "frequency_penalty"):
        props[name] = {"enum": [0, 0.0]}
    props["max_tokens"] = props["max_completion_tokens"] = {"type": "integer", "minimum": 1, "maximum": 64}
    return document


SCHEMA = schemathesis.openapi.from_dict(openapi())


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory, tiny_model_dir):
    from tests.background_server import start_server
    from tests.conftest import make_settings

    factory, _ = scripted_factory()
    server = start_server(make_settings(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, learn=False), factory)
    yield server, server.key("fuzzer", admin=True)
    server.stop()


@SCHEMA.parametrize()
@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_makes_the_server_fail(case, fuzz_target):
    server, key = fuzz_target
    response = case.call(base_url=server.root, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"


