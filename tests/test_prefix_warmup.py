"""proxy/prefix_warmup.py: when a version starts to serve, it reads its users' conversations."""

from __future__ import annotations

from nextstate.core.policy import PolicyRef
from tests.test_learner import wait_for


def test_a_new_version_reads_each_users_conversation_under_their_own_cache_partition(scripted):
    server, engine = scripted
    services = server.app.state.services
    for user in ("alice", "bob"):
        server.client(server.key(user)).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Hello, I am {user}."}], max_tokens=8)
    served = {r["user"]: r for r in server.records() if r["kind"] == "request"}
    salts = {user: engine.samplings[i].cache_salt for i, user in enumerate(("alice", "bob"))}
    assert salts["alice"] != salts["bob"]
    before = len(engine.prompts)

    async def publish():
        scope = services.policies.scope_of("alice")
        services.policies.publish(scope, PolicyRef(version=1, adapter="v1"))
        return scope

    scope = server.call(publish())
    users = [u for u in ("bob", "alice") if services.policies.scope_of(u) == scope]
    wait_for(lambda: len(engine.prompts) == before + len(users), timeout=10)
    read = engine.prompts[before:]
    for user, prompt, sampling in zip(users, read, engine.samplings[before:]):
        assert prompt == served[user]["prompt_ids"] + served[user]["response_ids"], "the prompt and our reply"
        assert sampling.max_new_tokens == 1 and sampling.cache_salt == salts[user]
