"""Keys (hashed, revocable at once) and the command line, run as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import openai
import pytest
from openai import OpenAI

from nextstate.core.stores.opener import Stores
from nextstate.core.stores.keys import KeyStore
from tests.background_server import free_port, wait_for_health
from tests.forked_process import run_cli


@pytest.fixture
def cli_env(tmp_path, tiny_model_dir) -> dict:
    return {**os.environ, "NEXTSTATE_DATA_DIR": str(tmp_path / "data"), "NEXTSTATE_MODEL": str(tiny_model_dir)}


def test_keys_are_stored_hashed(tmp_path):
    store = KeyStore(tmp_path / "k.sqlite3")
    key, secret = store.create("alice")
    store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert secret.encode() not in raw and secret[3:].encode() not in raw
    store = KeyStore(tmp_path / "k.sqlite3")
    assert store.verify(secret).user == "alice"
    assert store.verify(secret + "x") is None
    assert store.revoke(key.id) and not store.revoke(key.id)
    assert store.verify(secret) is None


def test_keys_work_the_same_on_both_backends_and_every_process_sees_them(tmp_path, database_url):
    """On PostgreSQL (NEXTSTATE_DATABASE_URL) two processes' stores are one: a key made by one
    (`nextstate keys create`) is checked by the other (a proxy), and revoked for both at once."""
    made_here, checked_there = KeyStore(tmp_path / "a.sqlite3", database_url), KeyStore(tmp_path / "a.sqlite3", database_url)
    try:
        key, secret = made_here.create("alice", rpm=60)
        found = checked_there.verify(secret)
        assert found is not None and (found.user, found.rpm, found.admin) == ("alice", 60, False)
        assert checked_there.get(key.id) == found and [k.id for k in checked_there.list()] == [key.id]
        assert made_here.revoke(key.id) and checked_there.verify(secret) is None
        made_here.create("bob", admin=True)
        assert checked_there.forget("alice") == 1 and [k.user for k in made_here.list()] == ["bob"]
    finally:
        made_here.close()
        checked_there.close()


def test_key_user_names_are_validated(tmp_path):
    store = KeyStore(tmp_path / "k.sqlite3")
    with pytest.raises(ValueError):
        store.create("two words")


def test_cli_create_list_revoke_against_a_live_server(server, cli_env):
    env = {**cli_env, "NEXTSTATE_DATA_DIR": str(server.settings.data_dir), "NEXTSTATE_PORT": str(server.settings.server.port)}
    created = run_cli("keys", "create", "--user", "carol", env=env)
    assert created.returncode == 0, created.stderr
    secret = re.search(r"ns-[A-Za-z0-9_\-]+", created.stdout).group(0)
    key_id = re.search(r"key_[0-9a-f]+", created.stdout).group(0)
    assert f'base_url="{server.base_url}"' in created.stdout
    client = server.client(secret)
    assert client.models.list().data[0].id == "tiny"

    listed = run_cli("keys", "list", env=env)
    assert "carol" in listed.stdout and key_id in listed.stdout and "active" in listed.stdout
    assert secret not in listed.stdout

    revoked = run_cli("keys", "revoke", key_id, env=env)
    assert revoked.returncode == 0
    with pytest.raises(openai.AuthenticationError):
        client.models.list()  # refused at once, no restart
    assert "revoked" in run_cli("keys", "list", env=env).stdout
    again = run_cli("keys", "revoke", key_id, env=env)
    assert again.returncode != 0 and "no active key" in again.stderr


def test_admin_routes_need_an_admin_key(server):
    admin = server.key("root", admin=True)
    assert KeyStore(Stores(server.settings).path("keys")).verify(admin).admin


def test_invalid_configuration_is_reported_clearly(cli_env):
    bad = run_cli("keys", "list", env={**cli_env, "NEXTSTATE_PORT": "notaport"})
    assert bad.returncode != 0 and "NEXTSTATE_PORT" in bad.stderr


def test_serve_command_starts_and_answers(cli_env):
    port = free_port()
    env = {**cli_env, "NEXTSTATE_PORT": str(port), "NEXTSTATE_SERVED_MODEL_NAME": "tiny"}
    secret = re.search(r"ns-[A-Za-z0-9_\-]+", run_cli("keys", "create", "--user", "dave", env=env).stdout).group(0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "nextstate.cli", "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        # The tiny model samples at random and may draw its end-of-text token early.
        tokens, finish = reply.usage.completion_tokens, reply.choices[0].finish_reason
        assert 1 <= tokens <= 4 and finish == ("length" if tokens == 4 else "stop"), (tokens, finish)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it
    assert proc.returncode in (0, -15), output
    assert "Application shutdown complete" in output, output
    assert f"http://127.0.0.1:{port}/v1" in output and "nextstate keys create" in output


def test_missing_model_dir_fails_at_start(cli_env, tmp_path):
    env = {**cli_env, "NEXTSTATE_MODEL": str(tmp_path / "nope"), "NEXTSTATE_PORT": str(free_port())}
    proc = run_cli("serve", env=env)
    assert proc.returncode != 0
    assert "not a Hugging Face model directory" in proc.stdout + proc.stderr


def test_invalid_mode_is_a_clear_start_up_error(cli_env):
    proc = run_cli("serve", env={**cli_env, "NEXTSTATE_MODE": "reinforce"}, timeout=60)
    assert proc.returncode != 0
    assert "NEXTSTATE_MODE" in proc.stderr and "binary" in proc.stderr


def test_missing_prm_prompt_is_a_clear_start_up_error(cli_env):
    proc = run_cli("serve", env={**cli_env, "NEXTSTATE_PRM_PROMPT": "prm_nope"}, timeout=60)
    assert proc.returncode != 0 and "prm_nope" in proc.stderr
