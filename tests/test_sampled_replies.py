"""A reply the client echoes word for word comes back in the next prompt as the ids the model
sampled, for its own person only (modelio/prompt_encoder.py `remember`)."""

from __future__ import annotations

import httpx

TEXT = "hello   world, hello"


def test_the_next_prompt_holds_the_reply_as_sampled_and_only_for_its_person(scripted):
    server, engine = scripted
    tokenizer = engine.tokenizer
    sampled = [i for ch in TEXT for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert sampled != tokenizer(TEXT, add_special_tokens=False)["input_ids"]  # not the tokenizer's own
    engine.script(sampled, "fine", "fine")
    first = [{"role": "user", "content": "Greet the world."}]
    alice = server.client(server.key("alice"))
    reply = alice.chat.completions.create(model="tiny", messages=first, max_tokens=40)
    assert reply.choices[0].message.content == TEXT
    following = first + [{"role": "assistant", "content": TEXT}, {"role": "user", "content": "Again."}]
    alice.chat.completions.create(model="tiny", messages=following, max_tokens=5)
    turn, again = engine.prompts[0], engine.prompts[1]
    assert again[: len(turn) + len(sampled)] == turn + sampled  # the kept prefix runs on through the reply
    # Bob sends the same words: his prompt is encoded as the tokenizer does
    server.client(server.key("bob")).chat.completions.create(model="tiny", messages=following, max_tokens=5)
    assert engine.prompts[2] != again
    assert engine.prompts[2][: len(turn)] == turn
    # Alice forgotten: nothing of her replies shapes a prompt any more
    admin = server.key("admin", admin=True)
    assert httpx.delete(f"{server.base_url}/admin/users/alice", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    server.client(server.key("alice")).chat.completions.create(model="tiny", messages=following, max_tokens=5)
    assert engine.prompts[3] == engine.prompts[2]
