"""Take your adapter with you (nextstate/export.py): a standard PEFT adapter that peft loads to
the same numbers nextstate serves, from the command line, a user key's own route and an admin's."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import httpx
import pytest
import torch

from tests.test_learner import PROMPT, feed, learning_server, served_samples, wait_for


@pytest.fixture
def trained(server_factory):
    server = learning_server(server_factory, batch_size=3, adapter_scope="user")
    feed(server, served_samples(server, 3))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    return server


def test_the_export_loads_in_peft_and_scores_as_nextstate_serves_it(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")},
           "NEXTSTATE_DATA_DIR": str(trained.settings.data_dir), "NEXTSTATE_ADAPTER_SCOPE": "user"}
    out = tmp_path / "alice-adapter"
    done = subprocess.run([sys.executable, "-m", "nextstate.cli", "export", "--user", "alice", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
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
    assert theirs.tolist() == pytest.approx(ours, abs=1e-4)
    again = subprocess.run([sys.executable, "-m", "nextstate.cli", "export", "--user", "alice", str(out)], env=env,
                           capture_output=True, text=True, timeout=120)
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
