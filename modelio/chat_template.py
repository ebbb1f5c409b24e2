"""Turn OpenAI messages (+ tools) into the exact token ids the engine sees.

The proxy renders prompts itself instead of letting the engine do it, so the ids it records
for training are the ids that were actually sampled from: no re-templating, no drift. Models
whose chat template knows no tools (SmolLM2's, for one) still get tools, rendered in the
Hermes/Qwen style that the tool-call parser reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nextstate.modelio.prompt_encoder import PromptEncoder

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def parse_arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """Tool-call arguments as an object, the way HF chat templates expect them; text that is
    not a JSON object stays text."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def tool_call_text(name: str, arguments: dict[str, Any] | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{TOOL_CALL_CLOSE}'


def _inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Hermes-style rendering for templates that know no tools: the tool list joins the system
    prompt, tool calls become <tool_call> text and tool results user <tool_response> turns."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"])
            content = f"{msg['content']}\n{calls}" if msg["content"] else calls
            out.append({"role": "assistant", "content": content})
        elif msg["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    if tools:
        preamble = _TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string value in a JSON-like value, without recursion (keys are not
    counted: a template may not write them, and a lower bound must not count what it may not)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    prefill: str  # text forced at the start of the reply; part of the prompt, not sampled


class ChatRenderer:
    def __init__(self, tokenizer: Any, extra_stop_ids: list[int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; nextstate serves chat models only")
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)  # the conversation so far is not tokenized again
        self.template_knows_tools = "tools" in tokenizer.chat_template
        stops = set(extra_stop_ids or [])
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        stops.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        self.stop_token_ids = tuple(sorted(stops))
        # The most UTF-8 bytes of text one token can stand for. Measured on the vocabulary's
        # own spelling, which for byte-level BPE writes a byte as one character of up to two
        # bytes: an over-estimate, so `fewest_tokens` never over-counts.
        self.max_token_bytes = max(1, max((len(token.encode("utf-8")) for token in vocab), default=1))

    def fewest_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        """A lower bound on the prompt's length in tokens, from the bytes of its text alone, in
        one pass over the request and no tokenization: a 15 MB prompt took 21 s and +2.5 GiB to
        tokenize before it was found too long for the model."""
        return _text_bytes([messages, tools or []]) // self.max_token_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatRenderer:
        from transformers import AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        extra: list[int] = []
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        except OSError:
            pass
        return cls(tokenizer, extra)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        owner: str | None = None,
    ) -> RenderedPrompt:
        """Prompt ids for plain-dict `messages` and `tools` (OpenAI's shapes), as a recorded Turn
        keeps them, so a turn can be re-rendered exactly, e.g. for the teacher. `owner`: whose
        conversation it is: their replies come back as sampled (`remember_reply`)."""
        tool_dicts = list(tools) if tools and tool_choice != "none" else None
        if self.template_knows_tools:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tool_dicts, add_generation_prompt=True, tokenize=False
            )
        else:
            text = self.tokenizer.apply_chat_template(
                _inline_tools(messages, tool_dicts), add_generation_prompt=True, tokenize=False
            )
        # A forced call (required, or a named function) starts the reply with the tag; the
        # engine then decodes the call's JSON under its schema (modelio.tool_calls).
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        prefill = f"{TOOL_CALL_OPEN}\n" if tool_dicts and forced else ""
        return RenderedPrompt(ids=self.encoder.encode(text + prefill, owner), prefill=prefill)

    def remember_reply(self, owner: str, prompt_ids: list[int], reply_ids: list[int]) -> bool:
        """A later prompt of `owner`'s holding this reply's text gets the ids sampled for it
        (PromptEncoder.remember)."""
        return self.encoder.remember(owner, prompt_ids, reply_ids)

    def forget_replies(self, owner: str) -> None:
        """`owner` is forgotten: so are the replies kept for their prompts."""
        self.encoder.forget(owner)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
