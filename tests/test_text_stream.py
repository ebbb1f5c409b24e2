"""Incremental detokenisation and stop strings."""

from __future__ import annotations

from transformers import AutoTokenizer

from nextstate.modelio.text_stream import StopStringMatcher, StreamDetokenizer, WindowDetokenizer, incremental_detokenizer


def test_multibyte_text_streams_without_broken_characters(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Grüße, 世界! naïve café — ok 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = incremental_detokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_both_detokenizers_agree_token_by_token(tiny_model_dir):
    """The DecodeStream path (fast tokenizers) and the window path (slow ones) release the
    same text at the same tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert isinstance(incremental_detokenizer(tok), StreamDetokenizer)
    ids = tok("Grüße, 世界! naïve café — ok 🙂 done", add_special_tokens=False)["input_ids"]
    stream, window = StreamDetokenizer(tok), WindowDetokenizer(tok)
    assert [stream.push(i) for i in ids] == [window.push(i) for i in ids]
    assert stream.flush() == window.flush()


def test_special_tokens_never_reach_the_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    detok = incremental_detokenizer(tok, skip_ids=(end,))
    ids = tok("hello", add_special_tokens=False)["input_ids"] + [end]
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hello"


def test_stop_string_split_across_deltas():
    m = StopStringMatcher(["</answer>"])
    out = [m.push(t) for t in ["The answer is 4.", "</ans", "wer> and more"]]
    assert "".join(out) == "The answer is 4." and m.stopped
    assert m.push("later") == "" and m.flush() == ""


def test_false_start_of_a_stop_string_is_released():
    m = StopStringMatcher(["STOP"])
    out = [m.push(t) for t in ["ST", "OMP", " fine"]] + [m.flush()]
    assert "".join(out) == "STOMP fine" and not m.stopped


def test_earliest_stop_string_wins():
    m = StopStringMatcher(["bb", "a"])
    assert m.push("xxbbya") == "xx"
