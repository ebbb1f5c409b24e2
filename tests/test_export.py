"""Take your adapter with you (nextstate/export.py): a standard PEFT adapter that peft loads to
the same numbers nextstate serves, from the command line, a user key's own route and an admin's."""

from __future__ import annotations

import io
import json
import tarfile

import httpx
import pytest
import torch

from tests.forked_process import nextstate_env, run_cli
from tests.test_learner import PROMPT, feed, learning_server, served_samples, wait_for
from tests.tiny_model import SERVED_TOLERANCE


@pytest.fixture
def trained(server_factory):
    server = learning_server(server_factory, batch_size=3, adapter_scope="user")
    feed(server, served_samples(server, 3))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    return server


def test_the_export_loads_in_peft_and_scores_as_nextstate_serves_it(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = nextstate_env(data_dir=trained.settings.data_dir, adapter_scope="user")
    out = tmp_path / "alice-adapter"
    done = run_cli("export", "--user", "alice", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    readme = (out / "README.md").read_text()
    assert "--lora-modules nextstate-alice-v1=" in readme and "--lora-paths nextstate-alice-v1=" in readme
    assert "forgetting on general text" in readme
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"

    model_dir = trained.settings.engine.model
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(out)).eval()
    response = [11, 12, 13, 14, 15]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + response])).logits[0]
    theirs = torch.log_softmax(logits.float(), -1)[len(PROMPT) - 1 : -1].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    services = trained.app.state.services
    ours = trained.call(services.turns.engine.score(PROMPT + response, len(PROMPT), adapter=services.policies.current("alice").adapter))
    assert theirs.tolist() == pytest.approx(ours, abs=SERVED_TOLERANCE)
    again = run_cli("export", "--user", "alice", str(out), env=env)
    assert again.returncode != 0 and "not empty" in again.stderr, "an export never overwrites"


def test_a_user_key_takes_its_own_adapter_and_an_admin_anyones(trained):
    alice, bob, admin = trained.key("alice"), trained.key("bob"), trained.key("root", admin=True)
    mine = httpx.get(f"{trained.root}/v1/me/adapter", headers={"Authorization": f"Bearer {alice}"})
    assert mine.status_code == 200 and mine.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(mine.content)) as tar:
        assert sorted(tar.getnames()) == [f"nextstate-alice-v1/{n}" for n in
                                          ("README.md", "adapter_config.json", "adapter_model.safetensors")]
    none = httpx.get(f"{trained.root}/v1/me/adapter", headers={"Authorization": f"Bearer {bob}"})
    assert none.status_code == 404 and "no adapter" in none.json()["error"]["message"]
    assert httpx.get(f"{trained.root}/v1/me/adapter?version=7", headers={"Authorization": f"Bearer {alice}"}).status_code == 404
    assert httpx.get(f"{trained.root}/v1/admin/users/alice/adapter", headers={"Authorization": f"Bearer {bob}"}).status_code == 403
    theirs = httpx.get(f"{trained.root}/v1/admin/users/alice/adapter", headers={"Authorization": f"Bearer {admin}"})
    assert theirs.status_code == 200 and theirs.content == mine.content
    assert "/v1/me/adapter" in trained.app.openapi()["paths"]


def test_in_the_shared_scope_the_adapter_is_an_admins_to_export(server_factory):
    server = learning_server(server_factory, batch_size=3)
    feed(server, served_samples(server, 3))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    refused = httpx.get(f"{server.root}/v1/me/adapter", headers={"Authorization": f"Bearer {server.key('alice')}"})
    assert refused.status_code == 403 and "shared" in refused.json()["error"]["message"]
    admin = server.key("root", admin=True)
    assert httpx.get(f"{server.root}/v1/admin/users/alice/adapter", headers={"Authorization": f"Bearer {admin}"}).status_code == 200


def gguf_tensors(reader) -> dict:
    """A GGUF file's tensors by name, each in numpy's order (GGUF lists dimensions innermost first)."""
    import numpy as np

    return {t.name: np.array(t.data).reshape(list(reversed([int(n) for n in t.shape]))) for t in reader.tensors}


def test_the_gguf_export_is_a_llama_cpp_lora_adapter_named_and_ordered_as_its_base(trained, tmp_path):
    """`--format gguf` on the test model (Qwen2: llama.cpp keeps its rows in order): one GGUF
    file of type adapter, LoRA alpha, and an `.lora_a`/`.lora_b` pair per adapted weight under
    the base GGUF's own tensor names, with the PEFT matrices as they are."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    env = nextstate_env(data_dir=trained.settings.data_dir, adapter_scope="user")
    out = tmp_path / "alice-gguf"
    done = run_cli("export", "--user", "alice", "--format", "gguf", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "nextstate-alice-v1.gguf"]
    assert "--lora nextstate-alice-v1.gguf" in (out / "README.md").read_text()
    reader = GGUFReader(out / "nextstate-alice-v1.gguf")

    def field(name):
        part = reader.fields[name]
        value = part.parts[part.data[0]]
        return bytes(value).decode() if part.types[0].name == "STRING" else float(value[0])

    assert field("general.type") == "adapter" and field("adapter.type") == "lora" and field("general.architecture") == "qwen2"
    tensors = gguf_tensors(reader)
    assert "blk.0.attn_q.weight.lora_a" in tensors and "blk.1.ffn_down.weight.lora_b" in tensors
    peft = {k: v for k, v in load_file(str(next(trained.settings.adapters_dir.glob("alice/*/adapter_model.safetensors")))).items()}
    a = peft["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = peft["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert np.array_equal(tensors["blk.0.attn_q.weight.lora_a"], a) and np.array_equal(tensors["blk.0.attn_q.weight.lora_b"], b)
    assert len(tensors) == len(peft), "every A and B, nothing else"
    refused = httpx.get(f"{trained.root}/v1/me/adapter?format=onnx", headers={"Authorization": f"Bearer {trained.key('alice')}"})
    assert refused.status_code == 400
    tar = httpx.get(f"{trained.root}/v1/me/adapter?format=gguf", headers={"Authorization": f"Bearer {trained.key('alice')}"})
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        assert sorted(archive.getnames()) == ["nextstate-alice-v1/README.md", "nextstate-alice-v1/nextstate-alice-v1.gguf"]


def test_llama_query_and_key_rows_are_reordered_as_the_gguf_base_holds_them():
    """A Llama GGUF holds q and k with each head's rotary halves interleaved; nextstate's model
    is the Hugging Face layout transformers' GGUF loader makes of it. The export's reordering
    must undo exactly what that loader did, on B's rows (A keeps its columns), q and k only."""
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from nextstate.modelio.gguf_lora import permute_rows

    rng = np.random.default_rng(0)
    gguf_q, gguf_k = rng.standard_normal((9 * 64, 576)), rng.standard_normal((3 * 64, 576))
    loader = LlamaTensorProcessor()
    hf_q, hf_k = loader._reverse_permute_weights(gguf_q, 9, 9), loader._reverse_permute_weights(gguf_k, 9, 3)
    assert not np.array_equal(hf_q, gguf_q)
    assert np.array_equal(permute_rows(hf_q, 9), gguf_q) and np.array_equal(permute_rows(hf_k, 3), gguf_k)
    b, a = rng.standard_normal((9 * 64, 16)), rng.standard_normal((16, 576))
    assert np.allclose(permute_rows(b, 9) @ a, permute_rows(b @ a, 9)), "reordering B reorders the delta's rows"


def test_a_llama_adapter_gets_its_q_and_k_reordered_and_other_architectures_are_refused(tmp_path):
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    from nextstate.modelio.gguf_lora import CannotExportGguf, gguf_adapter, permute_rows

    rng = np.random.default_rng(1)
    config = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}
    shapes = {"q_proj": 32, "k_proj": 16, "v_proj": 16}
    tensors = {}
    for module, out in shapes.items():
        prefix = f"base_model.model.model.layers.0.self_attn.{module}"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((4, 32)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, 4)).astype(np.float32)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    path = tmp_path / "out.gguf"
    path.write_bytes(gguf_adapter(tmp_path, config, alpha=8.0))
    read = gguf_tensors(GGUFReader(path))
    b = lambda m: tensors[f"base_model.model.model.layers.0.self_attn.{m}.lora_B.weight"]  # noqa: E731
    assert np.array_equal(read["blk.0.attn_q.weight.lora_b"], permute_rows(b("q_proj"), 4))
    assert np.array_equal(read["blk.0.attn_k.weight.lora_b"], permute_rows(b("k_proj"), 2))
    assert np.array_equal(read["blk.0.attn_v.weight.lora_b"], b("v_proj")), "v keeps its rows"
    with pytest.raises(CannotExportGguf, match="'gemma2'.*supported"):
        gguf_adapter(tmp_path, {**config, "model_type": "gemma2"}, alpha=8.0)
