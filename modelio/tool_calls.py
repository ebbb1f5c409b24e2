"""Hermes/Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

The parser reads them out of generated text incrementally, so that streaming clients get
content deltas as they are generated and a tool-call delta as soon as its block closes.

A reply is the text before the first call, then the calls. Once a call has closed, only more
calls may follow (parallel calls, separated by whitespace): the first other text ends the
reply (`ended`), and that text, like a block left unfinished or invalid after a valid call, is
not part of it. An agent runs the calls of a reply whose finish reason is "tool_calls"; a
model that rambles on after a valid call (small ones do) must not cost the call.

Before any call, a block that is not valid JSON with a `name` stays content: the client sees
what the model wrote rather than a call that was never made. `forced_call_schema` is the JSON
schema a call must follow when the client forces one (tool_choice "required" or a function).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from nextstate.modelio.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True)
class ParsedToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseOutput:
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def forced_call_schema(tools: list[dict], tool_choice: str | dict | None) -> str | None:
    """JSON schema (as JSON text) of the `{"name": ..., "arguments": ...}` object a forced
    call must be: one of the tools for "required", the named one for a named choice; None
    when nothing is forced."""
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    else:
        return None
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options}, ensure_ascii=False)


def _as_call(block: str, index: int) -> ParsedToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(index=index, id=f"call_{secrets.token_hex(12)}", name=obj["name"], arguments=arguments)


class ToolCallParser:
    def __init__(self, enabled: bool = True, parallel: bool = True) -> None:
        self.enabled = enabled
        self.parallel = parallel
        self._buf = ""
        self._in_block = False
        self._held_space = ""  # trailing whitespace that a following tool call would swallow
        self.calls: list[ParsedToolCall] = []
        self.ended = False  # the calls are complete: nothing more belongs to the reply

    def push(self, text: str) -> ParseOutput:
        if not self.enabled:
            return ParseOutput(content=text)
        out = ParseOutput()
        if self.ended:
            return out
        self._buf += text
        while True:
            if self._in_block:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return self._settle(out)
                block = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CALL_CLOSE) :]
                self._in_block = False
                self._finish_block(block, out, closed=True)
                if self.calls and not self.parallel:
                    self._end()
                    return out
            else:
                start = self._buf.find(TOOL_CALL_OPEN)
                if start >= 0:
                    text, rest = self._buf[:start], self._buf[start + len(TOOL_CALL_OPEN) :]
                else:  # hold back what may be the start of a tag
                    keep = next((n for n in range(len(TOOL_CALL_OPEN) - 1, 0, -1) if self._buf.endswith(TOOL_CALL_OPEN[:n])), 0)
                    text, rest = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                if not self.calls:
                    out.content += text
                elif text.strip():  # after a call, anything but whitespace and calls ends the reply
                    self._end()
                    return out
                self._buf = rest
                if start < 0:
                    return self._settle(out)
                self._in_block = True
                out.content = out.content.rstrip()
                self._held_space = ""

    def _end(self) -> None:
        self.ended = True
        self._buf = ""
        self._in_block = False
        self._held_space = ""

    def _settle(self, out: ParseOutput) -> ParseOutput:
        """Hold back trailing whitespace: if a tool call comes next it is dropped, as the
        whitespace around tool-call blocks is formatting, not something the model said."""
        text = self._held_space + out.content
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        out.content = stripped
        return out

    def flush(self) -> ParseOutput:
        """End of generation: an unclosed block still counts if its JSON is complete; after a
        valid call, an unfinished or invalid block is dropped."""
        out = ParseOutput()
        if not self.ended:
            if self._in_block:
                self._finish_block(self._buf, out, closed=False)
            elif not self.calls:
                out.content += self._buf
            if not self.calls:
                out.content = self._held_space + out.content
        self._end()
        return out

    def _finish_block(self, block: str, out: ParseOutput, closed: bool) -> None:
        call = _as_call(block.strip(), len(self.calls))
        if call is None:
            if self.calls:  # junk after a valid call: the reply ends with the calls
                self._end()
            else:
                out.content += TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
            return
        self.calls.append(call)
        out.tool_calls.append(call)
