"""Read Hermes/Qwen-style `<tool_call>{json}</tool_call>` blocks out of generated text.

The parser is incremental so that streaming clients get content deltas as they are generated
and a tool-call delta as soon as its block closes. A block that is not valid JSON with a
`name` stays content: the client sees what the model wrote rather than a call that was never
made.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from proxy.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


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
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._buf = ""
        self._in_block = False
        self._held_space = ""  # trailing whitespace that a following tool call would swallow
        self.calls: list[ParsedToolCall] = []

    def push(self, text: str) -> ParseOutput:
        if not self.enabled:
            return ParseOutput(content=text)
        self._buf += text
        out = ParseOutput()
        while True:
            if self._in_block:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return self._settle(out)
                block = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CALL_CLOSE) :]
                self._in_block = False
                self._finish_block(block, out, closed=True)
            else:
                start = self._buf.find(TOOL_CALL_OPEN)
                if start >= 0:
                    out.content += self._buf[:start]
                    self._buf = self._buf[start + len(TOOL_CALL_OPEN) :]
                    self._in_block = True
                    out.content = out.content.rstrip()
                    self._held_space = ""
                    continue
                keep = next((n for n in range(len(TOOL_CALL_OPEN) - 1, 0, -1) if self._buf.endswith(TOOL_CALL_OPEN[:n])), 0)
                out.content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return self._settle(out)

    def _settle(self, out: ParseOutput) -> ParseOutput:
        """Hold back trailing whitespace: if a tool call comes next it is dropped, as the
        whitespace around tool-call blocks is formatting, not something the model said."""
        text = self._held_space + out.content
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        out.content = stripped
        return out

    def flush(self) -> ParseOutput:
        """End of generation: an unclosed block still counts if its JSON is complete."""
        out = ParseOutput()
        if self._in_block:
            self._finish_block(self._buf, out, closed=False)
        else:
            out.content += self._buf
        self._buf = ""
        self._in_block = False
        held, self._held_space = self._held_space, ""
        if not self.calls:
            out.content = held + out.content
        elif not out.content.strip():
            out.content = ""
        else:
            out.content = held + out.content
        return out

    def _finish_block(self, block: str, out: ParseOutput, closed: bool) -> None:
        call = _as_call(block.strip(), len(self.calls))
        if call is None:
            out.content += TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
            return
        self.calls.append(call)
        out.tool_calls.append(call)
