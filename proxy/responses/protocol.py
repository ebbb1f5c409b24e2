"""OpenAI's Responses API: the request nextstate accepts, and its conversion to a turn.

The OpenAI Agents SDK and Codex send `POST /v1/responses`: `input` as a string or a list of
items (messages, `function_call`, `function_call_output`), `instructions` as the system
prompt, flat function tools, and optionally `previous_response_id` to continue a stored
response instead of resending the conversation. `ResponsesRequest.to_turn_messages` turns
that into the OpenAI chat shape the rest of nextstate speaks — an assistant's text and the
function calls after it become one assistant message with `tool_calls`, as chat completions
would have returned it — so a Responses conversation is rendered, matched to its session,
judged and trained like the same conversation through chat completions.

Unknown fields are ignored; known ones nextstate cannot honour (images and files, background
mode) are a 400 that says so. Tools the API would run itself (`web_search` and the like) are
left out of the model's prompt: Codex sends web search unless told not to, and was refused on its
first request. A `namespace` tool's functions are offered as `namespace.function` and their calls
come back with `name` and `namespace` apart, as Codex sends them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nextstate.modelio.chat_template import parse_arguments
from nextstate.modelio.structured_output import reply_schema
from nextstate.proxy.wire import ExtraAllowedModel, JsonSchemaSpec, SessionFields, function_tool


class Part(ExtraAllowedModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> Part:
        if self.type not in ("input_text", "output_text", "text", "refusal"):
            raise ValueError(f"content parts of type '{self.type}' are not supported; this model takes text only")
        if self.text is None and self.type != "refusal":
            raise ValueError("a text content part needs 'text'")
        return self


class Item(ExtraAllowedModel):
    """An input item: a message (with or without `type`), a function call or its output."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    namespace: str | None = None  # function_call of a function inside a `namespace` tool
    arguments: str | None = None  # function_call
    output: str | list[Part] | None = None  # function_call_output

    @model_validator(mode="after")
    def _known(self) -> Item:
        kind = self.kind
        if kind == "message":
            if self.role is None or self.content is None:
                raise ValueError("a message item needs 'role' and 'content'")
        elif kind == "function_call":
            if not self.call_id or not self.name or self.arguments is None:
                raise ValueError("a function_call item needs 'call_id', 'name' and 'arguments'")
        elif kind == "function_call_output":
            if not self.call_id or self.output is None:
                raise ValueError("a function_call_output item needs 'call_id' and 'output'")
        elif kind != "reasoning":  # an earlier reply's reasoning, sent back: this model has none
            raise ValueError(f"input items of type '{kind}' are not supported here")
        return self

    @property
    def kind(self) -> str:
        return self.type or "message"

    def text(self) -> str:
        value = self.output if self.kind == "function_call_output" else self.content
        if isinstance(value, str):
            return value
        return "".join(part.text or "" for part in value or [])


class NamespacedFunction(ExtraAllowedModel):
    """A function inside a `namespace` tool."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(ExtraAllowedModel):
    """A function tool; a `namespace` tool groups function tools under its name (Codex sends its
    sub-agent tools so); any other type is a tool the API runs itself (`web_search`,
    `file_search`, ...), which this server cannot: it is left out of the model's prompt."""

    type: str
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[NamespacedFunction] | None = None  # a namespace's

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if self.type in ("function", "namespace") and not self.name:
            raise ValueError(f"a {self.type} tool needs 'name'")
        return self

    def functions(self) -> list[tuple[str, FunctionTool | NamespacedFunction]]:
        """The functions the model can call, each with the name it calls it by: a namespace's as
        `namespace.function`; none for a tool the API would run."""
        if self.type == "function":
            return [(self.name or "", self)]
        if self.type == "namespace":
            return [(f"{self.name}.{t.name}", t) for t in self.tools or []]
        return []


class NamedFunction(ExtraAllowedModel):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaSpec):
    """`text`, `json_object`, or `json_schema` with its `schema` (what `responses.parse` sends)."""

    type: Literal["text", "json_object", "json_schema"]

    @model_validator(mode="after")
    def _has_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format json_schema needs a schema")
        return self


class TextOptions(ExtraAllowedModel):
    format: TextFormat | None = None


class ResponsesRequest(SessionFields):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    previous_response_id: str | None = Field(None, max_length=200)
    store: bool | None = True
    background: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background responses are not supported; stream instead")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must be a string or a non-empty list of items")
        if isinstance(self.tool_choice, NamedFunction):
            if self.tool_choice.name not in {name for name, _ in self._functions()}:
                raise ValueError(f"tool_choice names '{self.tool_choice.name}', which is not in tools")
        elif self.tool_choice == "required" and not self._functions():
            raise ValueError("tool_choice 'required' needs tools")
        return self

    # ------------------------------------------------------------------ the turn's shapes

    @property
    def _format(self) -> TextFormat | None:
        return self.text.format if self.text else None

    def text_format(self) -> dict[str, Any]:
        """The `text.format` the Response object echoes."""
        return self._format.model_dump(by_alias=True, exclude_none=True) if self._format else {"type": "text"}

    def reply_schema(self) -> str | None:
        return reply_schema(self._format.type, self._format.schema_) if self._format else None

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as Responses items (what `…/input_items` lists): a string input
        is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return [item.model_dump(exclude_none=True) | {"type": item.kind} for item in self.input]

    def new_messages(self) -> list[dict[str, Any]]:
        """This request's input in chat shape (without instructions and earlier responses)."""
        items = [Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out: list[dict[str, Any]] = []
        for item in items:
            kind = item.kind
            if kind == "message":
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif kind == "function_call":
                name = f"{item.namespace}.{item.name}" if item.namespace else item.name
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": name, "arguments": parse_arguments(item.arguments)}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # the text it followed, one message
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def _functions(self) -> list[tuple[str, FunctionTool | NamespacedFunction]]:
        return [pair for tool in self.tools or [] for pair in tool.functions()]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        functions = self._functions()
        if not functions:
            return None
        return [function_tool(name, t.description, t.parameters) for name, t in functions]

    def left_out_tools(self) -> list[str]:
        """The tools the API would run itself, which the model is not offered."""
        return [t.type for t in self.tools or [] if t.type not in ("function", "namespace")]

    def call_names(self, name: str) -> dict[str, str]:
        """A call's `name` as the client knows it, with its `namespace` where it has one."""
        for tool in self.tools or []:
            if tool.type == "namespace" and name.startswith(f"{tool.name}.") and any(
                    name == f"{tool.name}.{t.name}" for t in tool.tools or []):
                return {"name": name.removeprefix(f"{tool.name}."), "namespace": tool.name or ""}
        return {"name": name}

    def tool_choice_plain(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice
