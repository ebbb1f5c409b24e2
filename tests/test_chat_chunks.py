"""Streamed text chunks come from a template (proxy/chat_completion/serving.py): they must be
byte for byte what building and dumping the chunk model gives."""

from __future__ import annotations

import types

from hypothesis import given, settings
from hypothesis import strategies as st

from nextstate.core.policy import PolicyRef
from nextstate.proxy.chat_completion.protocol import Delta
from nextstate.proxy.chat_completion.serving import ChatCompletionBuilder


def builder(model: str, include_usage: bool, want_logprobs: bool = False) -> ChatCompletionBuilder:
    prep = types.SimpleNamespace(id="chatcmpl-0123", created=1790000000, policy=None)
    b = ChatCompletionBuilder(prep, model, include_usage, want_logprobs)
    b.start(PolicyRef(version=7, adapter=None))
    return b


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), model=st.text(min_size=1, max_size=40), include_usage=st.booleans())
def test_a_text_chunk_is_the_models_chunk(text, model, include_usage):
    b = builder(model, include_usage)
    assert b.text_chunk(text) == b.chunk(Delta(content=text))


def test_the_template_stands_aside_where_it_cannot_hold():
    # a model named like the probe text: no template, the model builds every chunk
    b = builder("\x01nextstate text\x02", include_usage=False)
    assert b._text_chunk is None and b.text_chunk("hi") == b.chunk(Delta(content="hi"))
    # logprobs asked for: every chunk carries them, so none is plain text
    assert builder("m", include_usage=True, want_logprobs=True)._text_chunk is None


def test_a_stream_names_the_version_that_served_it_when_a_swap_replaced_the_prepared_one():
    """The builder is made before the engine admits the request; a swap in between moves the
    reply to the new version (proxy/turns.py `_pump`), and every chunk from the first says so."""
    b = ChatCompletionBuilder(types.SimpleNamespace(id="chatcmpl-0123", created=1790000000, policy=None), "m", False, False)
    assert '"system_fingerprint":"nextstate-v8"' in b.start(PolicyRef(version=8, adapter="shared-v8"))
    assert '"system_fingerprint":"nextstate-v8"' in b.text_chunk("hi")
