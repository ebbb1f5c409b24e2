"""Conversations stay with their owner: private files, forgetting a user, retention, quiet logs."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import httpx

from nextstate.cli import banner
from nextstate.core.settings import Settings
from nextstate.proxy.access_log import StripQueryStrings
from tests.forked_process import run_cli
from tests.test_learner import feed, learning_server, served_samples, wait_for

HELLO = [{"role": "user", "content": "my password is hunter2"}]


def chat(server, key: str, messages=HELLO, **headers) -> None:
    server.client(key).chat.completions.create(model="tiny", messages=messages, max_tokens=3, extra_headers=headers)


def test_the_data_dir_is_private(server_factory):
    server = learning_server(server_factory, adapter_scope="user")
    chat(server, server.key("alice"))
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    server.records()
    data = server.settings.data_dir
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for root, dirs, files in os.walk(data):
        for name in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o700, os.path.join(root, name)
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600, os.path.join(root, name)


def test_a_user_can_be_forgotten_while_the_server_runs(server_factory):
    server = learning_server(server_factory, adapter_scope="user")
    alice, bob, admin = server.key("alice"), server.key("bob"), server.key("root", admin=True)
    chat(server, alice, messages=[{"role": "user", "content": "alice's password is swordfish"}])
    stored = server.client(alice).responses.create(model="tiny", input="my pin is 4711", max_output_tokens=3)
    chat(server, bob)
    feed(server, served_samples(server, 4, user="alice"))
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1)
    assert httpx.delete(f"{server.base_url}/admin/users/alice", headers={"Authorization": f"Bearer {bob}"}).status_code == 403
    resp = httpx.delete(f"{server.base_url}/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert resp.status_code == 200 and resp.json()["adapter_deleted"] and resp.json()["keys"] == 1
    assert resp.json()["responses"] == 1
    assert server.app.state.services.responses.store.conversation("alice", stored.id) is None
    records = server.records()
    assert records and not [r for r in records if r.get("user") == "alice"]
    assert [r["user"] for r in records if r["kind"] == "request"] == ["bob"]
    assert not [s for s in server.app.state.services.samples.samples() if s.user == "alice"]
    assert not (server.settings.adapters_dir / "alice").exists()
    assert server.app.state.services.policies.current("alice").version == 0
    assert "swordfish" not in "".join(p.read_text() for p in server.settings.records_dir.glob("*.jsonl"))
    # nor anywhere else on disk: not in a SQLite file's free pages, not in its write-ahead log
    files = [p for p in server.settings.data_dir.rglob("*") if p.is_file()]
    assert any(p.name.endswith("-wal") for p in files)
    assert [p.name for p in files if b"swordfish" in p.read_bytes() or b"pin is 4711" in p.read_bytes()] == []
    assert httpx.post(f"{server.base_url}/chat/completions", json={"model": "tiny", "messages": HELLO},
                      headers={"Authorization": f"Bearer {alice}"}).status_code == 401
    chat(server, bob)  # everyone else goes on


def test_forget_on_the_command_line(tmp_path, tiny_model_dir, server_factory):
    server = server_factory()
    alice = server.key("alice")
    chat(server, alice, **{"X-Session-Id": "open-one"})
    chat(server, server.key("bob"))
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(server.settings.data_dir), "NEXTSTATE_ADAPTER_SCOPE": "shared"}
    refused = run_cli("forget", "--user", "alice", "--yes", env=env)
    assert refused.returncode != 0 and "server is running" in refused.stderr
    server.stop()
    done = run_cli("forget", "--user", "alice", "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert "1 key(s), 1 open session(s)" in done.stdout and "shared adapter keeps" in done.stdout
    text = "".join(p.read_text() for p in server.settings.records_dir.glob("*.jsonl"))
    assert "alice" not in text and "hunter2" in text  # bob said it too; his records stay


def test_records_past_their_retention_are_deleted(server_factory, tmp_path):
    old, new = time.time() - 3 * 86400, time.time()
    records = tmp_path / "s0" / "data" / "records"
    records.mkdir(parents=True)
    lines = [{"ts": old, "kind": "request", "user": "a"}, {"ts": new, "kind": "request", "user": "b"}]
    (records / "policy-v0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (records / "policy-v0001.jsonl").write_text(json.dumps(lines[0]) + "\n")
    server = server_factory(records_retention_days=1)
    wait_for(lambda: not (records / "policy-v0001.jsonl").exists(), timeout=10)
    assert [r["user"] for r in server.records()] == ["b"]


def test_no_docs_and_no_metrics_for_strangers(server, server_factory):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.root}{path}").status_code == 404
    assert httpx.get(f"{server.root}/metrics").status_code == 401
    open_server = server_factory(docs=True, metrics_public=True)
    assert httpx.get(f"{open_server.root}/openapi.json").status_code == 200
    assert httpx.get(f"{open_server.root}/metrics").status_code == 200


def test_binding_beyond_loopback_is_announced_with_its_real_address():
    text, warning = banner(Settings(host="0.0.0.0", port=9000))
    assert "http://0.0.0.0:9000/v1 (every network interface)" in text and "base_url=http://127.0.0.1:9000/v1" in text
    assert warning and "TLS" in warning
    assert banner(Settings(host="127.0.0.1", port=9000))[1] is None


def test_query_strings_never_reach_the_access_log():
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("1.2.3.4:5", "GET", "/v1/models?api_key=ns-secret", "1.1", 401), None)
    assert StripQueryStrings().filter(record)
    assert "ns-secret" not in record.getMessage() and "/v1/models?[query removed]" in record.getMessage()


def test_an_unusable_data_dir_is_one_clear_sentence(tmp_path, tiny_model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(blocker / "data"), "NEXTSTATE_MODEL": str(tiny_model_dir)}
    done = run_cli("serve", env=env)
    assert done.returncode != 0 and "cannot be used" in done.stderr and "Traceback" not in done.stderr


def test_a_cached_prefix_never_tells_one_user_what_another_sent(server):
    """An attacker who guesses another user's prompt must learn nothing from the prefix cache:
    neither `cached_tokens` nor a faster first token. Alice's own next turn keeps its reuse."""
    secret = "Alice's private notes: the merger closes on Friday, the code word is heron. " * 12
    alice = server.client(server.key("alice"))
    bob = server.client(server.key("bob"))
    ask = dict(model="tiny", max_tokens=2, temperature=0)
    alice.chat.completions.create(messages=[{"role": "user", "content": secret}], **ask)
    guess = secret[:-40] + "x" * 40  # the same text with its end wrong, as a guesser would send
    probe = bob.chat.completions.create(messages=[{"role": "user", "content": guess}], **ask)
    assert probe.usage.prompt_tokens > 400
    assert probe.usage.prompt_tokens_details.cached_tokens == 0
    again = alice.chat.completions.create(messages=[{"role": "user", "content": guess}], **ask)
    assert again.usage.prompt_tokens_details.cached_tokens > 300, "a user's own prefix is still reused"


def test_a_forgotten_users_cached_prefixes_are_out_of_reach_of_the_next_user_of_the_name(server_factory):
    """Forget alice, give the name alice a new key, resend her prompt: nothing of it comes back
    from the prefix cache (492 of 502 tokens did), since the cache partition follows the name's
    first key (`user_since`), which forgetting deletes."""
    import httpx

    server = server_factory(learn=False, judge_enabled=False)
    prompt = [{"role": "user", "content": "My bank PIN is 4921 and my street is Elm Road. " * 8}]
    alice = server.client(server.key("alice"))
    alice.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)
    again = alice.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "her own prefix is reused"
    alice.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)  # and a second key of hers shares it:
    second = server.client(server.key("alice"))
    assert second.chat.completions.create(model="tiny", messages=prompt, max_tokens=2).usage.prompt_tokens_details.cached_tokens > 0
    admin = server.key("root", admin=True)
    assert httpx.delete(f"{server.root}/v1/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    newcomer = server.client(server.key("alice"))
    reply = newcomer.chat.completions.create(model="tiny", messages=prompt, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_forget_through_one_process_reaches_what_another_holds_alone(server_factory, postgres):
    """alice chats through B; her forgetting is asked of A. The database forgets her at once;
    B's own request records and its copies of her sessions go within seconds, by the forget
    event A leaves in the database (nextstate/forget.py)."""
    import time

    import httpx

    url = postgres.fresh_database("forgetting")
    a, b = (server_factory(database_url=url, judge_enabled=False, learn=False) for _ in range(2))
    alice = b.client(b.key("alice"))
    alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "My PIN is quokka-4921."}], max_tokens=2)
    b.key("bob")
    b.client(b.key("bob")).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert any(r.get("user") == "alice" for r in b.records())
    admin = a.key("root", admin=True)
    assert httpx.delete(f"{a.root}/v1/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    deadline = time.monotonic() + 15
    while any(r.get("user") == "alice" for r in b.records()):
        assert time.monotonic() < deadline, "B still holds alice's records"
        time.sleep(0.2)
    # a word, not the digits: the records' hex ids (sess_c4921aa…) may hold any four digits
    assert "quokka" not in "".join(p.read_text() for p in b.settings.records_dir.glob("*.jsonl"))
    assert any(r.get("user") == "bob" for r in b.records()), "and only hers"
    assert not [key for key in b.app.state.services.sessions._sessions if key[0] == "alice"], "nor her sessions in memory"
