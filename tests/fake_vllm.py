"""A stand-in vLLM server for contract tests, built from the shapes vLLM 0.32 serves.

It serves `/v1/completions` (token-id prompts; streamed one event per token with
`continuous_usage_stats`, then a usage-only event and `[DONE]`; `prompt_logprobs` for scoring),
`/v1/load_lora_adapter` (200 and plain text; 400 "has already been loaded"),
`/v1/unload_lora_adapter`, `/v1/models` and `/health`, with the fields and answers the real
server gives (checked against it by tests/test_engine_contract.py). The model behind it is the
embedded engine, so what the client parses can be checked against a direct computation.

Like vLLM's default `--logprobs-mode raw_logprobs`, logprobs are at temperature 1, sampled and
prompt alike. What it does not imitate: structured outputs (the real server masks their
logprobs; the fake ignores `structured_outputs`), the prefix cache, `top_k` and the penalties.
"""

from __future__ import annotations

import contextlib
import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from nextstate.engine.base import SamplingParams
from nextstate.engine.local import LocalEngine
from tests.background_server import AppInThread


def _error(message: str, kind: str, code: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, code)


class FakeVLLM(AppInThread):
    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.requests: list[tuple[str, dict]] = []
        self.paths: dict[str, str] = {}  # loaded adapter → its path
        self.engine: LocalEngine | None = None

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            self.engine = await LocalEngine.open(model_dir, device="cpu")
            yield
            await self.engine.close()

        app = FastAPI(lifespan=lifespan)

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/v1/models")
        async def models():
            base = {"id": str(model_dir), "object": "model", "root": str(model_dir), "parent": None, "max_model_len": 4096}
            adapters = [{"id": n, "object": "model", "root": p, "parent": str(model_dir), "max_model_len": None}
                        for n, p in self.paths.items()]
            return {"object": "list", "data": [base, *adapters]}

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request):
            body = await request.json()
            self.requests.append(("/v1/load_lora_adapter", body))
            name, path = body.get("lora_name"), body.get("lora_path")
            if name in self.paths:
                return _error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                              "place, set 'load_inplace' to True.", "InvalidUserInput", 400)
            try:
                await self.engine.load_adapter(name, path)
            except Exception:  # noqa: BLE001
                return _error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
            self.paths[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request):
            body = await request.json()
            self.requests.append(("/v1/unload_lora_adapter", body))
            name = body.get("lora_name")
            if name not in self.paths:
                return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            del self.paths[name]
            await self.engine.unload_adapter(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.requests.append(("/v1/completions", body))
            adapter = body.get("model")
            if adapter is not None and adapter not in self.paths:
                return _error(f"The model `{adapter}` does not exist. Valid aliases: <path>", "NotFoundError", 404)
            if body.get("max_tokens", 16) < 1:
                return _error(f"max_tokens must be at least 1, got {body.get('max_tokens')}.", "BadRequestError", 400)
            ids = body["prompt"]
            if body.get("prompt_logprobs") is not None:
                scores = await self.engine.score(ids, 1, adapter=adapter)
                entries = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}} for t, lp in zip(ids[1:], scores)]
                return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "model": adapter or str(model_dir),
                        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                     "prompt_logprobs": entries}],
                        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}
            sampling = SamplingParams(
                max_new_tokens=body.get("max_tokens", 16),
                temperature=body.get("temperature", 1.0),
                top_p=body.get("top_p", 1.0),
                seed=body.get("seed"),
                stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                top_logprobs=body.get("logprobs") or 0,
            )
            return StreamingResponse(self._events(ids, sampling, adapter), media_type="text/event-stream")

        self.serve(app, 0, name="fake-vllm")

    def restart(self) -> None:
        """What a restarted vLLM looks like from outside: the same URL, no adapter loaded."""

        async def forget() -> None:
            for name in list(self.paths):
                del self.paths[name]
                await self.engine.unload_adapter(name)

        self.run(forget())

    def loaded_adapters(self) -> dict[str, str]:
        return dict(self.paths)

    async def _events(self, ids, sampling, adapter):
        rid = "cmpl-" + uuid.uuid4().hex
        sampled: list[int] = []
        usage = {}
        async for tok in self.engine.generate(ids, sampling, adapter):
            sampled.append(tok.token_id)
            raw = tok.logprob
            if sampling.temperature not in (0.0, 1.0):  # raw_logprobs: before temperature
                raw = (await self.engine.score(ids + sampled, len(ids) + len(sampled) - 1, adapter=adapter))[0]
            name = f"token_id:{tok.token_id}"
            # vLLM lists the sampled token besides the top N
            top = {name: raw} | {f"token_id:{t}": lp for t, lp in tok.top_logprobs}
            choice = {"index": 0, "text": "", "finish_reason": tok.finish_reason, "stop_reason": None,
                      "token_ids": [tok.token_id], "prompt_token_ids": ids if len(sampled) == 1 else None,
                      "logprobs": {"text_offset": [0], "token_logprobs": [raw], "tokens": [name], "top_logprobs": [top]}}
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(sampled), "total_tokens": len(ids) + len(sampled)}
            yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'choices': [choice], 'usage': usage})}\n\n"
        # cached prompt tokens only here, as vLLM tells them (the fake has no prefix cache)
        usage["prompt_tokens_details"] = {"cached_tokens": 0}
        yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
