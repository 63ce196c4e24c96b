"""OpenAI-compatible HTTP server: `loopjax serve MODEL [--host] [--port] [engine options]`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream with server-sent
events `data: {json}\\n\\n` ending in `data: [DONE]\\n\\n`), GET /v1/models, /health, /metrics, /version,
POST /tokenize (`prompt` or chat `messages` -> {count, max_model_len, tokens, token_strs}) and POST
/detokenize (`tokens` -> {prompt}), as vLLM's.

Contract:
- Bad requests get HTTP 400 with OpenAI's error JSON `{"error": {"message", "type",
  "param", "code"}}`, `param` naming the field; an unknown `model` 404 (as vLLM); a full
  queue 429 (a request needing more engine requests at once than max_waiting: 400, as no
  retry can pass); a dead engine 503, as
  does a request not yet answered (a full answer, a stream not begun) when the graceful
  shutdown (SIGTERM, Ctrl-C; 5 s) ends; a request lost to a step that failed on the device
  500, while the server serves on (async_engine.py). A stream that began gets the error (the
  shutdown's 503 too) as its last event before [DONE]. Any other exception (a bug): a one-line
  500 alike, its traceback logged. Request parsing and validation live in `openai_protocol.py`.
- `stream_options.include_usage` (true unless set false within stream_options, vLLM's default):
  every chunk has `"usage": null` (OpenAI's) but the last (no choices, the usage); vLLM's
  `continuous_usage_stats`: each chunk's choice's usage so far.
- Sampling and exit settings are request fields (OpenAI's plus loopjax's extras, see
  `SamplingParams.from_openai`); what a request leaves unset takes the model's generation_config.json
  defaults (vLLM's --generation-config auto, `generation_defaults.py`). Prompts are text (needs the
  tokenizer) or token-id lists.
- `n` samples per prompt (1 <= n <= max_n): one engine request each (`fan_out`: sample i
  uses seed + i), returned as choice `prompt_index * n + i`; a stream's chunks carry their
  choice's `index`; `usage` counts each prompt's tokens once and every choice's tokens.
  With the prefix cache on, samples 1.. start when sample 0 has prefilled: they share its
  prompt pages (not where they share none, `Engine.shares_prefix`: adaptive exits, a Huginn
  ring wrapping within the depth; all start at once).
- Each choice carries loopjax extras: `token_ids` and `exit_loops` (the new tokens' in
  a chunk, all of them in a full response); `usage` adds `submissions` (the count of device submissions).
  vLLM's `return_token_ids` adds `prompt_token_ids` (chat: at the top; streamed: once).
- `echo` (completions): the prompt's text, tokens and log-probabilities first, scored by
  `loopjax.score` (the identity path) in a thread while the engine generates
  (`openai_prompt_part.py`); streamed, before
  the tokens of each choice's first chunk (vLLM's); with max_tokens 0 (OpenAI's legacy,
  vLLM's) that part alone: no engine request, each choice finished by "length". Chat's `echo`
  and the answer's role: `RequestParser.chat_reply` (vLLM's). A full answer's echo (either
  endpoint) asks prompt_logprobs too, as vLLM's (`RequestParser._echo_prompt_logprobs`).
- `prompt_logprobs=k` (vLLM's extra): the same scoring in vLLM's shape
  (`openai_choice.prompt_logprobs`), on each completions choice, at the top of a chat
  response (its one prompt), as vLLM's server puts it. A request asking both scores once
  (top max(logprobs, k)); the choices of one prompt share its score. Streamed too (vLLM
  refuses `prompt_logprobs` > 0 with stream: its chunks have no place for them): on each
  completions choice's first chunk, at the top of a chat stream's first chunk.
- A client that disconnects mid-stream aborts all its requests (pages freed before the next
  step).
- With an `api_key` (`--api-key`, as vLLM's), every /v1 request must send `Authorization:
  Bearer <key>` (401 otherwise); /health, /ping, /version, /metrics, /tokenize and /detokenize stay open.
The endpoints that generate nothing live in `server_info.py`. This module, it,
`openai_errors.py` and `serve_cli.py` (the command line: flags, the port bound before the
engine is built, uvicorn) are the only ones that import FastAPI / uvicorn;
`create_app` serves an Engine or AsyncEngine in-process (tests run it with uvicorn in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from loopjax.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
)
from loopjax.chat import special_tokens
from loopjax.generation_defaults import sampling_defaults
from loopjax.openai_choice import Choice, usage_of, with_null_fields
from loopjax.openai_errors import APIError, bad_request, internal_error
from loopjax.openai_prompt_part import PromptPart, PromptScorer
from loopjax.openai_protocol import DEFAULT_MAX_N, RequestParser, echo_state_of, param_of
from loopjax.request_stream import merge_streams
from loopjax.server_info import add_info_routes

log = logging.getLogger("loopjax.server")


class EventStream(StreamingResponse):
    """A stream's response. NOTE: only uvicorn's graceful shutdown, out of time, cancels the task
    serving it (a client gone cancels the body's writer alone): the body then ends with the
    shutdown's 503 event and [DONE] (`events`), and the cancel ends here, as a full answer's in
    `answer`, not in uvicorn's "Exception in ASGI application" traceback per stream."""

    async def __call__(self, scope, receive, send):
        with contextlib.suppress(asyncio.CancelledError):
            await super().__call__(scope, receive, send)


def create_app(engine, model_name: str, *, model=None, max_waiting: int = 256,
               max_n: int = DEFAULT_MAX_N, admission_window_s: float = 0.0,
               api_key: str | None = None, trust_request_chat_template: bool = False,
               allowed_origins: tuple[str, ...] | list[str] = ("*",),
               chat_template: str | None = None, model_aliases: tuple[str, ...] = (),
               generation_config: str = "auto", override_generation_config: dict | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an Engine or AsyncEngine) as `model_name`.

    The tokenizer, chat template and config come from `model` (default: `engine.model`);
    `max_n` caps the samples per prompt; max_waiting and admission_window_s go to the
    AsyncEngine built around an Engine; `api_key` guards the /v1 endpoints;
    trust_request_chat_template lets a chat request send its own chat_template (vLLM's flag: a
    sandboxed jinja2 template, but any client's); allowed_origins: the origins browsers may call
    it from (CORS, vLLM's default: any; the API key still applies); chat_template replaces the
    model's (vLLM's --chat-template); model_aliases: more names a request may send as `model`
    (vLLM's further --served-model-name names); generation_config: "auto" takes the model's sampling
    defaults for what a request leaves unset, "vllm" none (vLLM's --generation-config,
    generation_defaults.py); override_generation_config: generation_config.json keys merged over
    them (vLLM's --override-generation-config). The app's lifespan starts the AsyncEngine and shuts
    it down."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        # NOTE: no client can send an empty key (HTTP strips the header's trailing space)
        raise ValueError(f"api_key must be a non-empty str (None: no key), got {api_key!r}")
    aengine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(
        engine, max_waiting=max_waiting, admission_window_s=admission_window_s)
    model = model if model is not None else getattr(aengine.engine, "model", None)
    tokenizer = getattr(model, "tokenizer", None)
    vocab_size = getattr(cfg := getattr(model, "cfg", None), "vocab_size", None)
    # NOTE: the engine may serve less context than the model has (its scheduler's limit).
    sched = getattr(getattr(aengine.engine, "scheduler", None), "config", None)
    max_context = getattr(sched, "max_seq_len", None) or getattr(cfg, "max_context_len", None)
    config = getattr(aengine.engine, "config", None)
    max_logprobs = getattr(config, "max_logprobs", None)
    defaults = sampling_defaults(getattr(model, "generation_config", None), generation_config,
                                 override_generation_config)
    if defaults:  # vLLM's line
        log.info("Using default chat and completion sampling params from model: %s", defaults)
    parser = RequestParser(model_name, tokenizer, chat_template or getattr(model, "chat_template", None),
                           special_tokens(model), vocab_size, max_context, max_n, max_logprobs,
                           echo_state_of(model, config), trust_request_chat_template, tuple(model_aliases),
                           defaults)

    if problem := parser.template_problem():  # vLLM's start-up warning; the chats it fails get a 400
        log.warning("the chat template failed on a probe conversation (such chats get a 400): %s", problem)
    scorer = PromptScorer(model, getattr(sched, "num_loops", None), config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()

    async def authorized(request: Request):
        """/v1 requests carry the server's API key (when it has one) as a bearer token."""
        if api_key is None or not request.url.path.startswith("/v1/"):
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                           None, "authentication_error")

    app = FastAPI(title="loopjax", lifespan=lifespan, dependencies=[Depends(authorized)])
    app.state.async_engine = aengine
    # NOTE: vLLM's CORS defaults (any method and header, no credentials): a browser's preflight
    # OPTIONS was a 405, so browser clients could not call the server
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    # NOTE: any other exception is a bug: OpenAI's error JSON (a 500 naming it) rather than
    # uvicorn's plain text; Starlette re-raises it after this answer, so uvicorn logs the traceback.
    app.add_exception_handler(Exception, lambda request, exc: internal_error(exc).response())
    # NOTE: a client gone while its body was read (any POST) is no bug: 499 as a full answer's
    # (nobody reads it), not a 500 with a logged traceback and uvicorn's ERROR line
    app.add_exception_handler(ClientDisconnect, lambda request, exc: JSONResponse({}, status_code=499))

    def shutting_down() -> APIError:  # a request the graceful shutdown's timeout cut
        return APIError(503, "server shutting down", None, "server_error")

    def engine_error(e: EngineDeadError | RequestFailedError) -> APIError:
        """503 while the engine is gone; 500 for a request a failed step lost (others run on)."""
        return APIError(503 if isinstance(e, EngineDeadError) else 500, str(e), None, "server_error")

    async def submit_all(body, jobs: list[tuple[list[int], object]], arrived: float) -> list:
        """All (prompt ids, params) admitted at once (one engine turn), or none: the first
        error maps to HTTP. `arrived`: the request's perf_counter arrival (TTFT counts from it)."""
        try:
            return await aengine.submit_all(jobs, arrival_time=arrived)
        except QueueFullError as e:  # counted once in requests_rejected_total, whatever len(jobs)
            raise APIError(429, str(e), None, "rate_limit_error") from None
        except EngineDeadError as e:
            raise engine_error(e) from None
        except ValueError as e:  # the engine's one line, less its internal request id
            message = re.sub(r"^request '[0-9a-f]+': ", "", str(e))
            raise bad_request(message, param_of(message, body) or "prompt") from None
        except RuntimeError as e:  # add_request's bug, that request alone (async_engine.py)
            raise APIError(500, str(e), None, "server_error") from None

    async def submit_choices(body, prompts: list[list[int]], params, arrived: float) -> list:
        """One stream per choice; choice p * n + i is prompt p's sample i (vLLM's order).

        NOTE: requests admitted together each prefill their prompt (pages enter the prefix
        cache at the update of the step that wrote them). So with the cache on and a full
        page to share, each prompt's sample 0 goes first and the others follow at its first
        output: they take its cached prompt pages and prefill only the rest."""
        samples = params.fan_out()
        jobs, n = [(ids, sample) for ids in prompts for sample in samples], len(samples)
        page_size = getattr(sched, "page_size", None)
        # NOTE: adaptive rows (and a wrapping Huginn ring) share no cached pages: their samples
        # would wait for nothing
        shares = getattr(aengine.engine, "shares_prefix", None)
        shareable = (page_size and shares is not None and shares(params)
                     and any(len(p) > page_size for p in prompts))
        # NOTE: requests admitted together all wait for a first token: more than max_waiting are
        # refused on an idle server too, so a 400 here, not a 429 that every retry gets again.
        at_once = len(prompts) * (n - 1) if n > 1 and shareable else len(jobs)
        if at_once > aengine.max_waiting > 0:
            raise bad_request(f"this request needs {at_once} engine requests at once (prompts x n), more "
                              f"than this server queues (max_waiting={aengine.max_waiting}); send fewer "
                              f"prompts or a smaller n", "n" if n > 1 else "prompt")
        if n == 1 or not shareable:
            return await submit_all(body, jobs, arrived)
        firsts = await submit_all(body, jobs[::n], arrived)
        try:
            await asyncio.gather(*(stream.started.wait() for stream in firsts))
            rest = await submit_all(body, [job for k, job in enumerate(jobs) if k % n], arrived)
        except BaseException:  # refused, engine gone, or the handler was cancelled
            for stream in firsts:
                stream.close()
            raise
        return [firsts[k // n] if k % n == 0 else rest[k - k // n - 1] for k in range(len(jobs))]

    async def handle(request: Request, chat: bool):
        arrived = time.perf_counter()  # every choice's TTFT counts from here (vLLM's arrival)
        body = parser.body(await request.body())
        prompts = parser.prompts(body, chat)
        params = parser.sampling(body, chat, prompts)
        # NOTE: each Choice detokenizes its outputs as it streams them and matches the stop
        # strings on that text (closing its stream as stopped), so the engine makes no text.
        scores_only = parser.scores_only(body, chat)  # echo, max_tokens 0: no engine request
        streams = [] if scores_only else await submit_choices(
            body, prompts, dataclasses.replace(params, stop=(), detokenize=False), arrived)
        choices = [Choice(i, tokenizer, params, prompt=prompts[i // params.n],
                          ids_as_names=bool(body.get("return_tokens_as_token_ids")))
                   for i in range(len(prompts) * params.n)]
        for c in choices if scores_only else ():
            c.finish_reason = "length"  # the echoed prompt is all of it
        prompt = PromptPart(scorer, parser, body, prompts, params, chat, tokenizer)  # echo, prompt_logprobs
        role, chat_echo = parser.chat_reply(body) if chat else (None, "")
        # vLLM's: the X-Request-Id header, else the request_id field, names the response
        named = request.headers.get("x-request-id") or body.get("request_id")
        rid = ("chatcmpl-" if chat else "cmpl-") + (named or uuid.uuid4().hex)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}

        def prompt_ids(c: Choice) -> dict:  # vLLM's return_token_ids: the prompt's ids too
            return {"prompt_token_ids": prompts[c.index // params.n]} if body.get("return_token_ids") else {}

        def usage(one: Choice | None = None):  # the request's, or one choice's so far
            return usage_of(choices if one is None else [one], prompts, params.n)

        async def run_choices():
            """Yields (choice, text delta, new tokens) per output; stops a choice at its stop string."""
            async for i, out in merge_streams(streams):
                c = choices[i]
                if c.finish_reason is not None:
                    continue
                delta, num_new = c.update(out)
                if c.finish_reason is not None and not out.finished:
                    streams[i].close(stopped=True)  # a stop string matched: free the engine row now
                yield c, delta, num_new

        if not body.get("stream"):
            async def drain():
                async for _ in run_choices():
                    pass

            consumer = asyncio.create_task(drain())
            # NOTE: a client gone before the answer is complete aborts its requests (pages back).
            try:
                while not (await asyncio.wait({consumer}, timeout=0.25))[0]:
                    if await request.is_disconnected():
                        consumer.cancel()
                        return JSONResponse({}, status_code=499)
            except asyncio.CancelledError:  # the graceful shutdown ran out of time (`answer`): drop them
                consumer.cancel()
                for stream in streams:
                    stream.close()
                raise
            if isinstance(consumer.exception(), EngineDeadError | RequestFailedError):
                raise engine_error(consumer.exception())
            consumer.result()
            head["object"] = "chat.completion" if chat else "text_completion"
            head["choices"] = [c.answer(chat, role, chat_echo) | ({} if chat else prompt_ids(c))
                               for c in choices]
            head |= prompt_ids(choices[0]) if chat else {}
            if prompt.asked:
                part = await prompt.resolve()
                if not chat:
                    for c, answer in zip(choices, head["choices"], strict=True):
                        prompt.put(c, answer, part)
                elif prompt.k is not None:
                    head["prompt_logprobs"] = part[1][0]
            head["usage"] = usage()
            return JSONResponse(with_null_fields(head, chat))

        options = body.get("stream_options")
        # NOTE: vLLM's include_usage defaults to true within stream_options ({} asks the usage)
        include_usage = options is not None and options.get("include_usage", True) is True
        options = options or {}
        if include_usage:  # OpenAI's: every chunk carries usage, null until the last one's
            head["usage"] = None
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        sse = "data: {}\n\n".format

        announced = set()  # choices whose prompt_token_ids were sent

        def chunk(choice: dict, c: Choice, **top) -> str:
            """One choice's event; with vLLM's continuous_usage_stats, that choice's usage so far;
            with return_token_ids, its prompt's ids on its first (a chat's at the top)."""
            if c.index not in announced:
                announced.add(c.index)
                top |= prompt_ids(c) if chat else {}
                choice = choice if chat else choice | prompt_ids(c)
            return sse(json.dumps({**head, "choices": [choice], **top, **({"usage": usage(c)} if continuous
                                                                           else {})}))

        async def events():
            try:
                # NOTE: as vLLM's, a chat choice opens with a chunk of no tokens, its role (the
                # first one's top: prompt_logprobs, once scored), and its echo follows in a chunk of
                # its own, when there is text; a completions choice's first chunk of tokens carries
                # the prompt's part before them (echo's text and logprobs, prompt_logprobs), and
                # echo with max_tokens 0 is that part alone, one chunk per choice.
                part = await prompt.resolve() if prompt.asked else None
                for c in choices if chat else ():
                    top = {"prompt_logprobs": part[1][0]} if prompt.k is not None and c.index == 0 else {}
                    yield chunk(c.opening(chat, {"role": role, "content": ""}), c, **top)
                for c in choices if chat and chat_echo else ():
                    yield chunk(c.opening(chat, {"content": chat_echo}), c)
                unprompted = set() if chat or part is None else set(range(len(choices)))

                def first_carries_prompt(c: Choice, choice: dict) -> dict:
                    if c.index in unprompted:
                        unprompted.discard(c.index)
                        prompt.put(c, choice, part)
                    return choice

                for c in choices if scores_only else ():
                    yield chunk(first_carries_prompt(c, c.opening(chat, {})), c)
                async for c, delta, num_new in run_choices():
                    choice = c.fields(len(c.token_ids) - num_new, chat)
                    choice.update({"delta": {"content": delta}} if chat else {"text": delta})
                    yield chunk(first_carries_prompt(c, choice), c)
                if include_usage:
                    yield sse(json.dumps({**head, "choices": [], "usage": usage()}))
            except (EngineDeadError, RequestFailedError) as e:
                yield sse(engine_error(e).response().body.decode())
            except asyncio.CancelledError:  # NOTE: the graceful shutdown ran out of time (`answer`): the
                # stream ends as any other, not cut mid-body (uvicorn cancels once; the writes don't wait)
                yield sse(shutting_down().response().body.decode())
            except APIError as e:  # the scorer's error, after the stream began
                yield sse(e.response().body.decode())
            except Exception as e:  # a bug: the stream's last event names it (its traceback logged)
                log.exception("stream %s failed", rid)
                yield sse(internal_error(e).response().body.decode())
            finally:  # NOTE: also when the client leaves while the prompts are scored
                for stream in streams:
                    stream.close()
            yield sse("[DONE]")

        return EventStream(events(), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})

    async def answer(request: Request, chat: bool):
        """`handle`'s response; a 503 when uvicorn cancels it before the response began.
        NOTE: only uvicorn cancels a handler: its graceful shutdown (SIGTERM, Ctrl-C) ran out of
        time, wherever the handler waits (admission, sample 0's prefill, the answer, the
        scoring). A 503 rather than its 500; returned, not raised: the APIError handler runs in
        a worker thread, cancelled again."""
        try:
            return await handle(request, chat)
        except asyncio.CancelledError:
            return shutting_down().response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    add_info_routes(app, aengine, parser, root=getattr(model, "path", None) or model_name)
    return app
