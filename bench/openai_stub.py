"""An OpenAI-shaped chat server that streams one fixed reply and runs no model.

    python -m bench.openai_stub PORT MODEL_DIR --reply TEXT [--token-ms MS]

The stub behind LiteLLM in bench.proxy_overhead: the same reply, cut into the same tokens (the
MODEL_DIR tokenizer's), as the scripted SGLang stub nextstate is measured against, so both
proxies forward identical streams and only the proxies' own work differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(pieces: list[str], token_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "stub"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        created, model = int(time.time()), body.get("model", "m")
        usage = {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(pieces)}
            return JSONResponse({"id": "chatcmpl-stub", "object": "chat.completion", "created": created, "model": model,
                                 "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage})

        def chunk(delta: dict, finish: str | None = None) -> str:
            data = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            for piece in pieces:
                if token_s:
                    await asyncio.sleep(token_s)
                yield chunk({"content": piece})
            yield chunk({}, "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': 'chatcmpl-stub', 'object': 'chat.completion.chunk', 'created': created, 'model': model, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", type=int)
    parser.add_argument("model_dir")
    parser.add_argument("--reply", required=True)
    parser.add_argument("--token-ms", type=float, default=0.0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(args.reply, add_special_tokens=False)]
    uvicorn.run(build_app(pieces, args.token_ms / 1000), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
