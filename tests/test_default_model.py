"""End to end on the embedded default, SmolLM2-135M-Instruct (slow: converts ~20 s once)."""

from __future__ import annotations

import pytest

from nextstate.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model, find_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    try:
        find_gguf()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(str(exc))
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def test_conversion_is_cached(smol_dir):
    assert smol_dir.name == DEFAULT_MODEL_NAME
    assert ensure_default_model(smol_dir.parent) == smol_dir  # second call: no work
    assert (smol_dir / "config.json").exists() and (smol_dir / "tokenizer.json").exists()


def test_smollm2_answers_sensibly_over_http(server_factory, smol_dir):
    srv = server_factory(model=str(smol_dir), served_model_name=DEFAULT_MODEL_NAME)
    client = srv.client(srv.key("alice"))
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=20, stream=True
        )
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
