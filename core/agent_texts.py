"""What each agent harness writes into a conversation itself, as regexes: the defaults of the
NEXTSTATE_SESSION_VOLATILE_PATTERNS, NEXTSTATE_HARNESS_TURNS, NEXTSTATE_HARNESS_PATTERNS and
NEXTSTATE_HARNESS_WRAPPERS settings.

An agent's own text arrives mixed with its person's: dates and runtime lines in the prompts,
requests it sends for itself (titles, summaries), notices it puts where the person would answer.
Each kind has a job in nextstate (matching a request to its session, side turns, format failures,
what the judge reads). The texts are the harness's, found in captured traffic (tests/data) or in
its released package, one tuple per harness and kind, joined per kind at the end.
"""

from __future__ import annotations

import json
import re

# ---------------------------------------------------------------- OpenClaw 2026.9 (tests/data/openclaw-2026.9.6)

# A "[Mon 2026-11-23 09:25 UTC] " prefix on every user message, "Current date:"/"Current time:"
# lines in the system prompt (they change at midnight), the "Runtime: agent=... | model=..." line
# of the first user message, and the runtime-context block its full setup appends to requests.
OPENCLAW_VOLATILE = (
    r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})?(?: [A-Za-z][\w+:/-]*)?\] ",
    r"(?m)^Current (?:date|time): .*$",
    r"(?m)^Runtime: agent=.*$",
    r"(?s)<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>.*?<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
)
# Its notice that a turn produced no visible answer, where the person's next message would be.
OPENCLAW_NOTICES = (
    r"^(?:\[[^\]\n]{1,60}\]\s*)?The previous attempt did not produce a user-visible answer\.",
)
# Its pre-compaction memory flush (the last user message) and compaction summariser (the system prompt).
OPENCLAW_TURNS = (
    r"\A(?:\[[^\]\n]{1,60}\]\s*)?Pre-compaction memory flush\.",
    r"\AYou are a context summarization assistant\.",
)
# Its timestamp envelope on every message ("[Thu 2026-11-26 11:34 UTC] "), its runtime line, and
# its notice over a message typed while a reply was aborted, folded into the next one (after the
# envelope, when the envelope is there).
OPENCLAW_WRAPPERS = (
    r"\A\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})?(?: [A-Za-z][\w+:/-]*)?\] ",
    r"(?m)^Runtime: agent=.*(?:\n|\Z)",
    r"(?m)^(?:\[[^\]\n]{1,60}\]\s*)?\[Queued user message from a previous active turn; preserved as context only\. "
    r"Continue with the active prompt below\.\]\n?",
)

# ---------------------------------------------------------------- Claude Code 2.1 (tests/data/coding-agents)

# The <system-reminder> blocks it puts in user messages (dates, files it read, its own notes).
CLAUDE_CODE_VOLATILE = (r"(?s)<system-reminder>.*?</system-reminder>",)
# Its notices after a reply cut at max_tokens, sent as the next user message.
CLAUDE_CODE_NOTICES = (
    r"\AOutput token limit hit\b",
    r"\AYour response was cut off because it exceeded the output token limit\.",
)
# Its conversation summaries (compaction), asked in the last user message.
CLAUDE_CODE_TURNS = (r"(?m)^Your task is to create a detailed summary of (?:the|this) conversation",)
CLAUDE_CODE_WRAPPERS = (r"(?s)<system-reminder>.*?</system-reminder>\s*",)

# ---------------------------------------------------------------- Codex CLI 0.171 (tests/data/coding-agents)

# The <environment_context> user message it sends with each conversation (its date changes at midnight).
CODEX_VOLATILE = (r"(?s)<environment_context>.*?</environment_context>",)
CODEX_WRAPPERS = (r"(?s)<environment_context>.*?</environment_context>\s*",)
# Its interactive mode's title for a new thread, asked in a thread of its own (the header says so too).
CODEX_TURNS = (r"\AGenerate a concise, single-line task title\b",)

# ---------------------------------------------------------------- opencode 1.18 (tests/data/coding-agents)

# Its title generator, sent with the conversation's own session id before the first turn.
OPENCODE_TURNS = (r"\AYou are a title generator\. You output ONLY a thread title\.",)

# ---------------------------------------------------------------- the defaults, per kind

# Text removed before matching a request to its session (proxy/session_chain.py).
VOLATILE_PATTERNS = OPENCLAW_VOLATILE + CLAUDE_CODE_VOLATILE + CODEX_VOLATILE
# A next state matching one is the agent's own notice: the turn before it failed (learner rewards -1).
HARNESS_NOTICES = OPENCLAW_NOTICES + CLAUDE_CODE_NOTICES
# A request whose system prompt or last user message matches one is the agent's own: a side turn.
HARNESS_TURNS = OPENCLAW_TURNS + CLAUDE_CODE_TURNS + CODEX_TURNS + OPENCODE_TURNS
# Text an agent wraps around its person's words, removed from what the judge reads.
HARNESS_WRAPPERS = OPENCLAW_WRAPPERS + CLAUDE_CODE_WRAPPERS + CODEX_WRAPPERS

# --------------------------------------------------------------------------- which agent sent it

# The coding agents, known by their User-Agent. A coding agent's tool result is the environment's
# answer to a software-engineering step (its shell, its edits), the paper's general-agent setting
# (OpenClaw-RL appendix C), not a person's reaction: such a next state is judged with
# CODING_AGENT_TOOL_PRM, its user's own messages with the personal PRM as any other.
CODING_AGENTS = {
    "codex": r"^codex[_-]",  # codex_exec/0.171.0 (…), codex_cli_rs/…
    "claude-code": r"^claude-cli/",  # claude-cli/2.1.332 (external, sdk-cli)
    "opencode": r"^opencode/",  # opencode/1.18.33 ai-sdk/provider-utils/…
}
CODING_AGENT_TOOL_PRM = "prm_swe"


def coding_agent(user_agent: str | None) -> str | None:
    """The coding agent a request's User-Agent names, or None (OpenClaw, an SDK, anything else)."""
    if not user_agent:
        return None
    return next((name for name, pattern in CODING_AGENTS.items() if re.match(pattern, user_agent)), None)


# Codex says what each request is for in its x-codex-turn-metadata header (a JSON object):
# `request_kind` "turn" for the person's turns and their tool loop, other kinds for its own
# requests (compacting the history, say), which are side turns. `thread_source` says whose thread
# a request belongs to: "user" for the person's; its interactive mode also asks, in a thread of
# its own, for each new thread's title ("thread_title", request_kind "turn"): a side turn too
# (tests/data/coding-agents/codex-interactive.jsonl).
CODEX_TURN_METADATA = "x-codex-turn-metadata"
CODEX_MAIN_KINDS = ("turn",)
CODEX_MAIN_SOURCES = ("user",)


def harness_turn_type(headers: object) -> str | None:
    """"side" when the harness's own headers say a request is its own (not the person's turn),
    else None: the request's other hints decide."""
    get = getattr(headers, "get", None)
    raw = get(CODEX_TURN_METADATA) if get is not None else None
    if not raw:
        return None
    try:
        metadata = json.loads(raw)
        kind, source = metadata.get("request_kind"), metadata.get("thread_source")
    except (ValueError, AttributeError):
        return None  # not the JSON object Codex sends: no say
    if isinstance(kind, str) and kind not in CODEX_MAIN_KINDS:
        return "side"
    return "side" if isinstance(source, str) and source not in CODEX_MAIN_SOURCES else None
