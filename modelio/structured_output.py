"""The JSON schema a structured reply is decoded under (OpenAI's `response_format` on chat
completions, `text.format` on Responses).

`json_object` asks for any JSON object, `json_schema` for one valid under the client's schema —
what `client.chat.completions.parse(response_format=Model)`, `responses.parse(text_format=...)`,
the Agents SDK's `output_type`, LangChain's `with_structured_output` and Instructor send. The
engines decode under it as they do a forced tool call's arguments (engine/constraints.py on the
embedded engine, SGLang's own grammar backend), so the reply parses whatever the model.
"""

from __future__ import annotations

import json
from typing import Any


def reply_schema(kind: str, schema: dict[str, Any] | None) -> str | None:
    """The schema as JSON text for a format `kind`, or None for plain text."""
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        return json.dumps(schema or {"type": "object"}, ensure_ascii=False)
    return None
