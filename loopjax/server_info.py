"""The server's endpoints that generate nothing (`server.create_app` adds them), as vLLM's:
POST /tokenize (`prompt` or chat `messages` -> {count, max_model_len, tokens, token_strs}), POST
/detokenize (`tokens` -> {prompt}), GET /v1/models (a card per served name, its `root` the
checkpoint, `created` the server's start), /version, /health (503 once the engine is gone; /ping
too, vLLM's) and /metrics (Prometheus text)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from loopjax import __version__
from loopjax.openai_errors import bad_request


def add_info_routes(app: FastAPI, aengine, parser, *, root: str) -> None:
    """Serve the routes for `aengine` (an AsyncEngine) and `parser` (the RequestParser: the
    served name, tokenizer and context); `root`: the checkpoint's folder or preset name."""
    started = int(time.time())  # OpenAI's Unix time (the card's created was 0: 1970)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's `return_token_strs` adds each token's vocabulary string (`token_strs`)."""
        body = parser.body(await request.body())
        ids = parser.tokenize(body)
        strs = None
        if body.get("return_token_strs"):
            if parser.tokenizer is None:
                raise bad_request(f"model {parser.model_name!r} has no tokenizer to name tokens with",
                                  "return_token_strs")
            strs = [parser.tokenizer.id_to_token(t) for t in ids]
        return {"count": len(ids), "max_model_len": parser.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return {"prompt": parser.detokenize(parser.body(await request.body()))}

    # vLLM's one permission object per card (OpenAI's legacy shape: sampling and logprobs allowed)
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": started,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}

    @app.get("/v1/models")
    async def models():
        """A card per name the server answers to (vLLM's: aliases too), in vLLM's shape."""
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "loopjax", "root": root,
             "parent": None, "max_model_len": parser.max_context, "permission": [permission],
             "vocab_size": parser.vocab_size}
            for name in (parser.model_name, *parser.aliases)]}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for it, GET or POST
    @app.post("/ping")
    async def health():
        if not aengine.running:
            return JSONResponse({"status": "dead", "error": aengine.stop_reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(aengine.metrics.render(), media_type="text/plain; version=0.0.4")
