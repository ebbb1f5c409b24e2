"""The production engine: an SGLang server driven through its native HTTP API.

Targets SGLang's `/generate` (token ids in, token ids and logprobs out, streaming), and
`/load_lora_adapter` / `/unload_lora_adapter` for named adapters; launch SGLang with
`--enable-lora`, `--max-lora-rank` and `--lora-target-modules` matching the learner (see
deploy/). Shapes used, from SGLang's io_struct / tokenizer manager:

* request: `input_ids`, `sampling_params` {max_new_tokens, temperature, top_p, stop_token_ids,
  no_stop_trim, sampling_seed}, `return_logprob`, `top_logprobs_num`, `logprob_start_len`,
  `stream`, `lora_path` (always sent: null means the base model, on purpose).
* response: `output_ids`, `meta_info` {finish_reason: null | {type: stop|length|abort, ...},
  prompt_tokens, completion_tokens, output_token_logprobs: [[logprob, token_id, text|null]],
  output_top_logprobs, input_token_logprobs}. Streaming sends `data: {json}` events ending in
  `data: [DONE]`; each event holds everything so far, or only the new tokens when SGLang runs
  with --incremental-streaming-output; both are handled.
* scoring: `max_new_tokens: 0` with `logprob_start_len = start − 1`; `input_token_logprobs`
  then covers input_ids[start − 1:], and its first entry (that position's own logprob) is
  always null, so it is dropped: one logprob per scored token, aligned. The ids it echoes are
  not quite the ids sent: any id at or past `vocab_size − 1` comes back as 0 (0.5.23's
  logprob_result_processor clips "padded hash values from image tokens" that way, an off-by-one
  that also takes the vocabulary's last real token), so the echo is checked against the ids as
  SGLang clips them (`echoed_ids`). The logprob beside a clipped id is the real token's.
* logprobs, one convention: **temperature 1** ("raw"), for sampled and scored tokens alike.
  Stock SGLang takes prompt-token logprobs (what scoring reads) at temperature 1 whatever the
  request says, and sampled-token logprobs after temperature scaling unless the server runs
  with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`. With that variable set (deploy/ sets it) both are
  raw, so a turn's old logprobs and its OPD teacher's are on the same footing; its
  `logprob_temperature` is 1 and the learner computes its own at 1 too. `check_logprobs` finds
  a server without the variable at start-up and refuses it, rather than mixing temperatures.

* adapters (as SGLang 0.5.23 behaves, tests/test_engine_contract.py): a name once loaded is never
  forgotten — after `/unload_lora_adapter` a request naming it loads it again from its path, and
  loading that name again is refused as "already loaded" — so nextstate never sends a name it
  unloaded, and never gives a name to other weights (learner/versions.py: names carry a digest of
  the weights). A request naming an adapter SGLang never had (it restarted) fails with "has never
  been loaded", as a 400 or, streamed, as an error event after HTTP 200; the client loads it again.
* under a JSON-schema constraint the sampled logprobs come back after the grammar mask,
  renormalised (`EngineInfo.masked_constrained_logprobs`): the proxy scores such a reply again.

Failures, retries, reloads after a restart and the logprob check are engine/remote.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nextstate.engine.base import EngineBadGateway, GeneratedToken, SamplingParams
from nextstate.engine.remote import RemoteEngine

TARGET_SGLANG = "0.5.23 (tested for real by .ci/real-engines); other 0.5.x releases share the native /generate API"


def echoed_ids(ids: list[int], vocab_size: int) -> list[int]:
    """The prompt ids as SGLang echoes them beside their logprobs: 0 for any id at or past
    `vocab_size − 1` (see the module's docstring). A vocabulary size of 0 (unknown) clips nothing."""
    last = vocab_size - 1 if vocab_size > 0 else None
    return [0 if last is not None and t >= last else t for t in ids]


class SGLangEngine(RemoteEngine):
    server = "SGLang"
    generate_path = score_path = "/generate"
    # 0.5.23's tokenizer manager says "Got LoRA adapter that has never been loaded: NAME" (a 400,
    # or on a stream an HTTP 200 whose first event is {"error": {..., "code": 400}}); earlier 0.5
    # releases said "The following requested LoRA adapters are not loaded: NAME".
    lost_adapter_texts = ("has never been loaded", "LoRA adapters are not loaded")
    raw_logprob_remedy = ("Start SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1 in its environment "
                          "(deploy/launch.sh and compose.yaml do).")

    def _generate_payload(self, input_ids: list[int], sampling: SamplingParams, adapter: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids),
            # keep the stop token in output_ids: it was sampled, and the learner trains on it
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.json_schema is not None:
            params["json_schema"] = sampling.json_schema  # SGLang's own grammar backend
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": True,
            "lora_path": adapter,
        }
        if sampling.top_logprobs:
            payload["top_logprobs_num"] = sampling.top_logprobs
        if sampling.cache_salt is not None:
            # its radix cache matches prefixes only within one salt (io_struct's cache_salt)
            payload["cache_salt"] = sampling.cache_salt
        return payload

    def _event_tokens(self, event: dict[str, Any], seen: int, payload: dict[str, Any]) -> tuple[list[GeneratedToken], str | None]:
        meta = event["meta_info"]
        ids = list(event["output_ids"])
        logprobs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        # Cumulative events (SGLang's default) repeat everything so far; incremental ones
        # (--incremental-streaming-output) carry only new tokens. completion_tokens is always
        # the running total, which tells them apart.
        total = int(meta.get("completion_tokens", len(ids)))
        if len(ids) == total:
            ids, logprobs, tops = ids[seen:], logprobs[seen:], tops[seen:]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        tokens = []
        for k, (token_id, entry) in enumerate(zip(ids, logprobs)):
            if int(entry[1]) != int(token_id):
                raise ValueError(f"logprob entry for token {entry[1]} where {token_id} was sampled")
            top = tuple((int(t[1]), float(t[0])) for t in (tops[k] or [])) if k < len(tops) else ()
            tokens.append(GeneratedToken(int(token_id), float(entry[0]), top))
        if not seen and tokens and isinstance(meta.get("cached_tokens"), int):
            tokens[0] = dataclasses.replace(tokens[0], cached_prompt_tokens=meta["cached_tokens"])
        reason = meta.get("finish_reason")
        if reason is None:
            return tokens, None
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "abort":
            raise EngineBadGateway(f"SGLang aborted the generation: {reason.get('message', reason)}")
        return tokens, ("length" if kind == "length" else "stop")

    def _score_payload(self, input_ids: list[int], start: int, adapter: str | None) -> dict[str, Any]:
        return {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "stream": False,
            "lora_path": adapter,
        }

    def _scores(self, body: dict[str, Any], input_ids: list[int], start: int) -> list[float]:
        entries = body["meta_info"]["input_token_logprobs"][1:]
        got = [int(e[1]) for e in entries]
        if got != echoed_ids(input_ids[start:], self.info.vocab_size):
            raise ValueError(f"the scored tokens are not input_ids[{start}:] ({len(got)} entries for "
                             f"{len(input_ids) - start} tokens, first {got[:4]} for {list(input_ids[start:start + 4])}, "
                             f"cached_tokens {body['meta_info'].get('cached_tokens')})")
        return [float(e[0]) for e in entries]

    async def _server_load(self, name: str, path: str, retry: bool) -> str | None:
        return await self._load_on(self.base_url, name, path, retry)

    async def _server_unload(self, name: str) -> str | None:
        return await self._unload_on(self.base_url, name)

    async def _load_on(self, base_url: str, name: str, path: str, retry: bool) -> str | None:
        """SGLang never forgets a name (an unloaded adapter is loaded again from its path when a
        request names it) and refuses to load a name it holds as "already loaded": that is
        success when it holds the name for this very path."""
        body = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path}, retry=retry, ok_400=True,
                                base_url=base_url)
        if body.get("success", False):
            return None
        loaded = body.get("loaded_adapters")
        held = loaded.get(name) if isinstance(loaded, dict) else None  # the path SGLang has under this name
        message = str(body.get("error_message", body))
        return None if "already loaded" in message and held == path else message

    async def _unload_on(self, base_url: str, name: str) -> str | None:
        body = await self._post("/unload_lora_adapter", {"lora_name": name}, retry=False, ok_400=True, base_url=base_url)
        return None if body.get("success", False) else str(body.get("error_message", body))
