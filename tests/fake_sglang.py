"""A stand-in SGLang server for contract tests, built from SGLang's documented shapes.

It serves SGLang's native `/generate`, `/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models`
and `/health` with the request fields and response shapes the real server uses (io_struct.py's
GenerateReqInput / LoadLoRAAdapterReqInput; the tokenizer manager's output dicts:
`output_ids`, `meta_info.output_token_logprobs` as [logprob, token_id, text] triples,
cumulative streaming events or incremental ones, `finish_reason` {type: stop|length|abort},
a null first entry in `input_token_logprobs`). The model behind it is the embedded engine on
the tiny model, so what the client parses can be checked against a direct computation.
`mode` injects failures: "500", "hang", "garbage", "drop" (close mid-stream), "abort", "stall" (a
stream waits after its first event until the mode changes: a reply that cannot end before a test
kills what is reading it); `POST /fake/mode` sets it in a process of its own.
Adapters behave as SGLang 0.5.23's do (checked against the real server by
tests/test_engine_contract.py): a name, once loaded, is never forgotten — an unloaded adapter is
loaded again from its path when a request names it, and loading that name again is refused as
"already loaded" — and a request naming an adapter never loaded fails with "Got LoRA adapter that
has never been loaded" (a streamed one after an HTTP 200). What it does not imitate: logprobs
under a JSON-schema constraint (SGLang reports them after the grammar mask; the fake ignores
`json_schema`).

Logprobs as stock SGLang reports them: prompt-token logprobs (scoring) at temperature 1 whatever
the request's temperature; sampled-token logprobs after temperature scaling, or at temperature
1 when the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (`return_original_logprob`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nextstate.engine.base import SamplingParams
from nextstate.engine.local import LocalEngine
from tests.background_server import AppInThread


class FakeSGLang(AppInThread):
    """`engine_factory` swaps the model for another engine (bench/proxy_overhead uses a
    scripted one, so that only HTTP and the proxy cost time); `port` 0 picks a free one."""

    def __init__(self, model_dir, incremental: bool = False, engine_factory=None, port: int = 0,
                 return_original_logprob: bool = True) -> None:
        self.model_dir = model_dir
        self.incremental = incremental
        self.return_original_logprob = return_original_logprob
        self.mode = "ok"
        self.requests: list[tuple[str, dict]] = []
        self.generate_peers: list[int] = []  # the client port of each /generate: one per connection
        self.done_delay_s = 0.0
        self.truncated_scores = 0  # this many next scoring answers leave out their first input tokens
        self.ever_loaded: dict[str, str] = {}  # every adapter name loaded since the start, and its path
        self._adapter_updates = asyncio.Lock()
        self.engine: LocalEngine | None = None
        open_engine = engine_factory or (lambda: LocalEngine.open(model_dir, device="cpu"))

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            self.engine = await open_engine()
            yield
            await self.engine.close()

        app = FastAPI(lifespan=lifespan)

        @app.get("/health")
        async def health():
            return JSONResponse({}, 200 if self.mode != "500" else 503)

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.requests.append(("/generate", body))
            self.generate_peers.append(request.client.port if request.client else 0)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "internal error"}}, 500)
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "garbage":
                return StreamingResponse(iter(["data: {not json\n\n"]), media_type="text/event-stream")
            adapter = body.get("lora_path")
            if adapter is not None and adapter not in self.engine.adapters:
                if adapter in self.ever_loaded:
                    # SGLang 0.5.23 never forgets a name: it loads an unloaded adapter again,
                    # from the path it had, and answers
                    await self.engine.load_adapter(adapter, self.ever_loaded[adapter])
                else:
                    # its tokenizer manager raises this ValueError: a 400, or on a stream an
                    # HTTP 200 whose first event is the error
                    error = {"message": f"Got LoRA adapter that has never been loaded: {adapter}\n"
                                        f"All loaded adapters: dict_keys({sorted(self.ever_loaded)}).",
                             "type": "invalid_request_error", "code": 400, "retryable": False}
                    if body.get("stream"):
                        events = iter([f"data: {json.dumps({'error': error})}\n\n", "data: [DONE]\n\n"])
                        return StreamingResponse(events, media_type="text/event-stream")
                    return JSONResponse({"error": {"message": error["message"]}}, 400)
            params = body.get("sampling_params", {})
            if params.get("max_new_tokens") == 0:
                return await self._score(body, adapter, params)
            sampling = SamplingParams(
                max_new_tokens=params.get("max_new_tokens", 128),
                temperature=params.get("temperature", 1.0),
                top_p=params.get("top_p", 1.0),
                seed=params.get("sampling_seed"),
                stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                top_logprobs=body.get("top_logprobs_num") or 0,
            )
            rid = uuid.uuid4().hex
            events = self._events(body["input_ids"], sampling, adapter, rid)
            if body.get("stream"):
                return StreamingResponse(self._sse(events), media_type="text/event-stream")
            last = None
            async for event in events:
                last = event
            return JSONResponse(last)

        @app.post("/load_lora_adapter")
        async def load(request: Request):
            body = await request.json()
            self.requests.append(("/load_lora_adapter", body))
            async with self._adapter_updates:  # SGLang's tokenizer manager: one adapter update at a time
                return await self._load(body)

        @app.post("/unload_lora_adapter")
        async def unload(request: Request):
            body = await request.json()
            self.requests.append(("/unload_lora_adapter", body))
            async with self._adapter_updates:
                try:
                    await self.engine.unload_adapter(body["lora_name"])
                except Exception as exc:  # noqa: BLE001
                    return JSONResponse({"success": False, "error_message": str(exc), "loaded_adapters": None}, 400)
            return {"success": True, "error_message": "", "loaded_adapters": self._loaded()}

        @app.get("/fake/generations")
        async def served():  # for a test that runs this fake in a process of its own
            return [body.get("lora_path") for path, body in self.requests
                    if path == "/generate" and body["sampling_params"].get("max_new_tokens")]

        @app.post("/fake/mode")
        async def set_mode(request: Request):
            self.mode = (await request.json())["mode"]
            return {"mode": self.mode}

        @app.get("/v1/models")
        async def models():
            adapters = [{"id": n, "object": "model", "root": p, "parent": str(self.model_dir)} for n, p in self._loaded().items()]
            return {"object": "list", "data": [{"id": str(self.model_dir), "object": "model", "root": str(self.model_dir),
                                                "parent": None}, *adapters]}

        self.serve(app, port, name="fake-sglang")

    def restart(self) -> None:
        """What a restarted SGLang looks like from outside: the same URL, no adapter loaded."""

        async def forget() -> None:
            self.ever_loaded.clear()
            for name in list(self.engine.adapters):
                await self.engine.unload_adapter(name)

        self.run(forget())

    def loaded_adapters(self) -> dict[str, str]:
        """name → path of what is loaded now (as tests/real_engines/sglang_server.RealSGLang)."""
        return self._loaded()

    async def _load(self, body: dict) -> JSONResponse | dict:
        name = body["lora_name"]
        if name in self.ever_loaded:  # loaded or not now: SGLang 0.5.23 keeps the name for good
            if name not in self.engine.adapters:
                await self.engine.load_adapter(name, self.ever_loaded[name])
            return JSONResponse({"success": False, "error_message": f"Failed to load LoRA adapter {name} because it is "
                                 "already loaded", "loaded_adapters": self._loaded()}, 400)
        try:
            await self.engine.load_adapter(name, body["lora_path"])
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"success": False, "error_message": str(exc), "loaded_adapters": None}, 400)
        self.ever_loaded[name] = body["lora_path"]
        return {"success": True, "error_message": "", "loaded_adapters": self._loaded()}

    def _loaded(self) -> dict[str, str]:
        return {n: self.ever_loaded.get(n, "") for n in self.engine.adapters}

    async def _events(self, input_ids, sampling, adapter, rid):
        ids, logprobs, tops = [], [], []
        raw = self.return_original_logprob and sampling.temperature not in (0.0, 1.0)
        async for tok in self.engine.generate(input_ids, sampling, adapter):
            ids.append(tok.token_id)
            logprob = tok.logprob
            if raw:  # what SGLANG_RETURN_ORIGINAL_LOGPROB gives: the token's logprob before temperature
                logprob = (await self.engine.score(input_ids + ids, len(input_ids) + len(ids) - 1, adapter=adapter))[0]
            logprobs.append([logprob, tok.token_id, None])
            tops.append([[lp, t, None] for t, lp in tok.top_logprobs] if sampling.top_logprobs else None)
            finish = None
            if tok.finish_reason == "stop":
                finish = {"type": "stop", "matched": tok.token_id}
            elif tok.finish_reason == "length":
                finish = {"type": "length", "length": len(ids)}
            if self.mode == "abort" and len(ids) == 2:
                finish = {"type": "abort", "message": "aborted by the scheduler"}
            new = slice(len(ids) - 1, len(ids)) if self.incremental else slice(0, len(ids))
            meta = {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "output_token_logprobs": logprobs[new],
            }
            if sampling.top_logprobs:
                meta["output_top_logprobs"] = tops[new]
            yield {"text": None, "output_ids": ids[new], "meta_info": meta}
            if finish is not None:
                return

    async def _sse(self, events):
        n = 0
        async for event in events:
            n += 1
            if self.mode == "drop" and n == 3:
                return  # connection closes without a finish
            yield f"data: {json.dumps(event)}\n\n"
            while self.mode == "stall":
                await asyncio.sleep(0.05)
        if self.done_delay_s:
            await asyncio.sleep(self.done_delay_s)  # [DONE] some time after the finishing event
        yield "data: [DONE]\n\n"

    async def _score(self, body, adapter, params):
        ids = body["input_ids"]
        start = body["logprob_start_len"]
        # stock SGLang: prompt-token logprobs are at temperature 1, whatever the request says
        scores = await self.engine.score(ids, start + 1, adapter=adapter)
        # SGLang 0.5.23 echoes each id at or past vocab_size - 1 as 0 (it clips image-token hashes
        # that way, and the vocabulary's last real token with them); written out here on its own
        vocab = self.engine.info.vocab_size
        echoed = [t if not vocab or t < vocab - 1 else 0 for t in ids]  # 0: a scripted engine's, unknown
        entries = [[None, echoed[start], None]] + [[lp, t, None] for lp, t in zip(scores, echoed[start + 1 :])]
        if self.truncated_scores:  # as if a cached prefix had swallowed part of what was asked
            self.truncated_scores -= 1
            entries = entries[:1] + entries[3:]
        meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "completion_tokens": 0, "input_token_logprobs": entries, "output_token_logprobs": []}
        return {"text": "", "output_ids": [], "meta_info": meta}


def main(argv: list[str] | None = None) -> None:
    """python -m tests.fake_sglang PORT MODEL_DIR [--scripted TEXT] [--token-ms MS]: in its own process."""
    import argparse
    import threading

    from transformers import AutoTokenizer

    from tests.scripted_engine import ScriptedEngine

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("model_dir")
    parser.add_argument("--scripted", help="answer every request with this text instead of running the model")
    parser.add_argument("--token-ms", type=float, default=0.0, help="scripted: delay per token")
    args = parser.parse_args(argv)
    factory = None
    if args.scripted is not None:
        async def factory():
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
            return ScriptedEngine(tokenizer, default_reply=args.scripted, delay_s=args.token_ms / 1000)

    FakeSGLang(args.model_dir, incremental=True, engine_factory=factory, port=args.port)
    threading.Event().wait()  # serve until the parent terminates this process


if __name__ == "__main__":
    main()
