"""Failures while serving: a cancelled stream or a vanished client aborts its requests and
frees their pages, a full queue answers 429 (also when it fills in the middle of an `n`
fan-out), a step lost on the device fails its requests with 500, and after each the server
keeps serving; a dead engine answers 503 everywhere."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import io
import json
import threading
import time
import types

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_helpers import MODEL_NAME, LiveServer, wait_idle

import loopjax
from loopjax.openai_choice import Choice
from loopjax.server import create_app


def test_cancelled_stream_frees_pages(client, server):
    stream = client.completions.create(model=MODEL_NAME, prompt=list(range(10, 60)), max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].token_ids)
        if got >= 2:
            break
    assert server.aengine.stats()["pages_used"] > 0  # the stats of the step before the last chunk
    stream.close()
    stats = wait_idle(server.aengine)
    assert stats["pages_free"] > 0
    assert server.aengine.metrics.aborted.value >= 1


def test_client_gone_before_a_full_answer_aborts(server):
    before = server.aengine.metrics.aborted.value
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=1.0),
                   json={"prompt": [9, 8, 7], "max_tokens": 450, "ignore_eos": True})
    deadline = time.time() + 20
    while server.aengine.metrics.aborted.value == before:
        assert time.time() < deadline, "the request of a vanished client was not aborted"
        time.sleep(0.05)
    wait_idle(server.aengine)


def test_full_queue_gets_429(server, client):
    aengine = server.aengine
    waiting, aengine.num_waiting = aengine.num_waiting, aengine.max_waiting  # as if the queue were full
    try:
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2)
    finally:
        aengine.num_waiting = waiting
    assert aengine.metrics.rejected.value >= 1


def test_a_fan_out_the_queue_can_never_hold_is_400(server, client):
    """n=3 over a prompt of more than one page with max_waiting=1: sample 0 goes first, then
    samples 1 and 2 together, which the queue (max 1 waiting) can never hold. The client gets
    one 400 naming the limit at once (a 429 "retry later" would be refused again on every
    retry, as would a list of more prompts than max_waiting on an idle server), nothing is
    admitted and the server keeps serving."""
    aengine = server.aengine
    prompt = [13 + (i * 11) % 200 for i in range(40)]
    kw = dict(model=MODEL_NAME, n=3, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    requests, rejected = aengine.metrics.requests.value, aengine.metrics.rejected.value
    aengine.max_waiting = 1
    try:
        with pytest.raises(openai.BadRequestError, match=r"max_waiting=1") as e:
            client.completions.create(prompt=prompt, max_tokens=300, **kw)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError, match=r"needs 2 engine requests at once") as e:
            client.completions.create(prompt=[[5, 6], [7, 8]], max_tokens=2, model=MODEL_NAME)
        assert e.value.body["param"] == "prompt"
    finally:
        aengine.max_waiting = 256
    stats = wait_idle(aengine)
    assert stats["pages_free"] == stats["pages_total"]
    assert aengine.num_waiting == 0 and aengine.metrics.waiting.value == 0
    assert (aengine.metrics.requests.value - requests, aengine.metrics.rejected.value - rejected) == (0, 0)
    again = client.completions.create(prompt=prompt, max_tokens=4, **kw)  # ... and the server keeps serving
    assert [c.index for c in again.choices] == [0, 1, 2] and again.usage.completion_tokens == 12


def test_full_queue_in_the_middle_of_n_frees_every_sample():
    """n=4 while a request of n=2 waits (max_waiting=4): the queue holds 2 more, so the request
    is refused whole. The client gets one 429, counted once in requests_rejected_total (it counted
    each refused sample, and the admitted samples as accepted and aborted), and nobody is left
    waiting."""
    fake = FakeEngine()
    fake.paused = True  # admitted, never stepped: the first request keeps waiting
    app = create_app(fake, MODEL_NAME, max_waiting=4)
    aengine = app.state.async_engine
    with LiveServer(app) as live, concurrent.futures.ThreadPoolExecutor(1) as pool:
        url = live.url + "/v1/completions"
        first = pool.submit(httpx.post, url, json={"prompt": [1], "max_tokens": 3, "n": 2}, timeout=30)
        deadline = time.time() + 20
        while aengine.num_waiting < 2:
            assert time.time() < deadline, "the first request was not admitted"
            time.sleep(0.01)
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 3, "n": 4}, timeout=30)
        assert r.status_code == 429 and "retry later" in r.json()["error"]["message"]
        assert aengine.num_waiting == 2 and aengine.metrics.waiting.value == 2
        m = aengine.metrics
        assert (m.requests.value, m.aborted.value, m.rejected.value) == (2, 0, 1)
        fake.paused = False
        assert first.result().json()["choices"][0]["token_ids"] == [2, 3, 4]
        assert fake.requests == {}


def test_top_k_beyond_int32_is_off_and_the_engine_lives(client, server):
    """top_k of the vocabulary or more keeps every token (off), however large: 2**31 once
    overflowed the step's int32 sampling batch in the engine thread and killed the engine (every
    later request 503)."""
    kw = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=1.0, seed=9)
    off = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].token_ids
    huge = client.completions.create(**kw, extra_body={"ignore_eos": True, "top_k": 2**31})
    assert huge.choices[0].token_ids == off and server.aengine.running
    wait_idle(server.aengine)


def test_a_stop_token_id_past_int32_under_min_tokens_is_no_token(client, server):
    """A stop token id past the int32 range names no token: nothing to suppress before
    min_tokens (it once overflowed the step's int32 sampling batch and killed the engine)."""
    kw = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].token_ids
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [2**31],
                                                    "min_tokens": 2})
    assert r.choices[0].token_ids == plain and server.aengine.running
    wait_idle(server.aengine)


def test_dead_engine_answers_503():
    """A step that raises kills the engine loop: each open request gets a one-line 503 (a
    stream: as its last event before [DONE], after the tokens it had), later requests get
    503 and /health reports the engine dead."""
    fake = FakeEngine(fail_at_step=4)  # steps 1-3 give each request a token, step 4 raises
    fake.paused = True  # no step until both requests are admitted
    app = create_app(fake, MODEL_NAME)
    aengine = app.state.async_engine
    with LiveServer(app) as live, concurrent.futures.ThreadPoolExecutor(1) as pool:
        url = live.url + "/v1/completions"
        full = pool.submit(httpx.post, url, json={"prompt": [1], "max_tokens": 50}, timeout=30)
        with httpx.stream("POST", url, json={"prompt": [100], "max_tokens": 50, "stream": True},
                          timeout=30) as stream:
            deadline = time.time() + 20
            while aengine.num_waiting < 2:
                assert time.time() < deadline, "the two requests were not admitted"
                time.sleep(0.01)
            fake.paused = False
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == [101, 102, 103]
        error = chunks[-1]["error"]
        assert error["code"] == 503 and error["type"] == "server_error"
        assert error["message"] == "engine step failed: RuntimeError: device fell over"
        r = full.result()
        assert r.status_code == 503 and r.json()["error"]["message"] == error["message"]
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "engine is not running (RuntimeError: device fell over)"
        health = httpx.get(live.url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json() == {"status": "dead", "error": "RuntimeError: device fell over"}


def test_a_request_lost_on_the_device_is_500_and_the_server_serves_on():
    """A step that fails on the device and is recovered from (the Engine's StepFailedError)
    fails the requests it lost with a one-line 500 (a stream: as its last event before [DONE],
    after its tokens); later requests run, /health stays ok and /metrics counts the failure.
    (The server loop used to die on it: 503 for every later request.)"""
    fake = FakeEngine(lose_token=lambda t: t in (103, 1003))
    app = create_app(fake, MODEL_NAME)
    with LiveServer(app) as live:
        url = live.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": [1000], "max_tokens": 5}, timeout=30)
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {"message": "a step failed on the device; 1 lost", "type": "server_error",
                                     "param": None, "code": 500}
        with httpx.stream("POST", url, json={"prompt": [100], "max_tokens": 5, "stream": True},
                          timeout=30) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == [101, 102]
        assert chunks[-1]["error"]["code"] == 500
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [6, 7, 8]
        assert httpx.get(live.url + "/health", timeout=10).json() == {"status": "ok"}
        metrics = httpx.get(live.url + "/metrics", timeout=10).text
        assert "loopjax_step_failures_total 2" in metrics.splitlines()
    assert not fake.requests and not fake.lost


def test_a_full_answer_cut_by_shutdown_is_503():
    """SIGTERM / Ctrl-C: uvicorn waits for open requests (timeout_graceful_shutdown), then
    cancels them. A full answer still running then gets a one-line 503 and its requests count
    as aborted (it was a 500 "Internal Server Error" and a traceback in the log per request)."""
    fake = FakeEngine()
    fake.paused = True  # admitted, never stepped: the answer is still running at shutdown
    app = create_app(fake, MODEL_NAME)
    aengine = app.state.async_engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with LiveServer(app) as live:
            full = pool.submit(httpx.post, live.url + "/v1/completions", timeout=30,
                               json={"prompt": [1], "max_tokens": 50})
            deadline = time.time() + 20
            while aengine.num_waiting < 1:
                assert time.time() < deadline, "the request was not admitted"
                time.sleep(0.01)
        r = full.result()  # LiveServer's exit: 2 s of graceful shutdown, then the handler is cancelled
    assert r.status_code == 503, r.text
    assert r.json()["error"] == {"message": "server shutting down", "type": "server_error", "param": None,
                                 "code": 503}
    assert (aengine.metrics.requests.value, aengine.metrics.aborted.value) == (1, 1)


def test_health_after_a_stop_says_stopped():
    """/health of a server whose engine was stopped (not killed) says so: its error read 'None'.
    vLLM's /ping (GET or POST; it was a 404) answers as /health."""
    app = create_app(FakeEngine(), MODEL_NAME)
    with LiveServer(app) as live:
        assert httpx.get(live.url + "/health", timeout=10).json() == {"status": "ok"}
        assert httpx.post(live.url + "/ping", timeout=10).json() == {"status": "ok"}
        app.state.async_engine.shutdown()
        for path in ("/health", "/ping"):
            health = httpx.get(live.url + path, timeout=10)
            assert health.status_code == 503 and health.json() == {"status": "dead", "error": "stopped"}


def test_api_key_guards_the_v1_endpoints():
    """--api-key (vLLM's): a /v1 request without `Authorization: Bearer KEY`, or with another
    key, is a 401 in OpenAI's error shape (the openai client raises AuthenticationError);
    with it the request is served; /health and /metrics need none. A browser's CORS preflight
    needs none either (vLLM's CORS defaults: it was a 405, so browsers could not call the server);
    its answers let any origin in."""
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, api_key="s3cret")) as live:
        preflight = httpx.options(live.url + "/v1/chat/completions", timeout=10, headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        seen = httpx.get(live.url + "/v1/models", headers={"Origin": "http://ui.example"}, timeout=10)
        assert seen.status_code == 401 and seen.headers["access-control-allow-origin"] == "*"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(live.url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model=MODEL_NAME, prompt=[5, 6], max_tokens=2)
        served = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert served.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2).choices[0].token_ids
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        assert httpx.get(live.url + "/version", timeout=10).json() == {"version": loopjax.__version__} != {
            "version": "unknown"}
        assert httpx.get(live.url + "/metrics", timeout=10).status_code == 200


def test_an_add_request_bug_is_a_500_in_openais_error_shape():
    """An unexpected error of the engine's add_request (a bug in one request's checks) fails
    that request with a one-line 500 in OpenAI's error JSON, and the server serves on (it was
    uvicorn's plain-text "Internal Server Error", the message lost)."""
    fake = FakeEngine()
    add = fake.add_request

    def add_request(prompt_ids, params, request_id=None):
        if prompt_ids == [666]:
            raise TypeError("unexpected")
        return add(prompt_ids, params, request_id)

    fake.add_request = add_request
    with LiveServer(create_app(fake, MODEL_NAME)) as live:
        url = live.url + "/v1/completions"
        for stream in (False, True):
            r = httpx.post(url, json={"prompt": [666], "max_tokens": 2, "stream": stream}, timeout=30)
            assert r.status_code == 500, r.text
            assert r.json()["error"] == {"message": "request not admitted: TypeError: unexpected",
                                         "type": "server_error", "param": None, "code": 500}
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [6, 7]


def test_a_stream_cut_by_shutdown_counts_as_aborted():
    """uvicorn's graceful shutdown cancels a stream still running when its timeout ends: the
    stream ends with a 503 event and [DONE] (it was cut mid-body: the client's "incomplete chunked
    read"; uvicorn logged the cancel's traceback), and its requests count as aborted, as a full
    answer's do (they counted as neither finished nor aborted)."""
    fake = FakeEngine()
    fake.paused = True  # admitted, never stepped: the stream is still running at shutdown
    app = create_app(fake, MODEL_NAME)
    aengine = app.state.async_engine

    def stream(url):
        body = {"prompt": [1], "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as s:
            return [line.removeprefix("data: ") for line in s.iter_lines() if line]

    logged = io.StringIO()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.redirect_stderr(logged):
        with LiveServer(app) as live:
            done = pool.submit(stream, live.url + "/v1/completions")
            deadline = time.time() + 20
            while aengine.num_waiting < 1:
                assert time.time() < deadline, "the request was not admitted"
                time.sleep(0.01)
        events = done.result()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"] == {
        "message": "server shutting down", "type": "server_error", "param": None, "code": 503}, events
    assert "Exception in ASGI application" not in logged.getvalue(), logged.getvalue()
    assert (aengine.metrics.requests.value, aengine.metrics.aborted.value) == (1, 1)


def test_a_request_waiting_for_sample_0_when_shutdown_ends_is_503():
    """The 503 of a request the graceful shutdown's timeout cuts holds wherever its handler
    waits: here an n=2 request (prefix cache on) waiting for sample 0's prefill, streamed or
    not (both were uvicorn's plain-text 500 and a traceback: only the wait for the full
    answer answered 503)."""
    for stream in (False, True):
        fake = FakeEngine()
        fake.scheduler = types.SimpleNamespace(config=types.SimpleNamespace(enable_prefix_caching=True,
                                                                            page_size=1))
        fake.paused = True  # sample 0 admitted, never prefilled: samples 1.. wait for it
        app = create_app(fake, MODEL_NAME)
        aengine = app.state.async_engine
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with LiveServer(app) as live:
                full = pool.submit(httpx.post, live.url + "/v1/completions", timeout=30,
                                   json={"prompt": [1, 2, 3], "max_tokens": 5, "n": 2, "stream": stream})
                deadline = time.time() + 20
                while aengine.num_waiting < 1:
                    assert time.time() < deadline, "sample 0 was not admitted"
                    time.sleep(0.01)
            r = full.result()
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": "server shutting down", "type": "server_error", "param": None,
                                     "code": 503}
        assert (aengine.metrics.requests.value, aengine.metrics.aborted.value) == (1, 1)


def test_a_handler_bug_is_a_500_in_openais_error_shape(monkeypatch):
    """An unexpected exception in a request's handling (here a bug injected into the choice's
    fields) is a one-line 500 in OpenAI's error JSON naming it (a stream: its last event before
    [DONE]); its traceback is logged and the server serves on (it was uvicorn's plain-text
    "Internal Server Error", a stream cut without [DONE])."""
    real = Choice.fields

    def fields(self, start, chat):
        if self.token_ids[:1] == [667]:
            raise ZeroDivisionError("a bug\nits second line")
        return real(self, start, chat)

    monkeypatch.setattr(Choice, "fields", fields)
    want = {"message": "internal server error: ZeroDivisionError: a bug", "type": "server_error",
            "param": None, "code": 500}
    logged = io.StringIO()
    with contextlib.redirect_stderr(logged), LiveServer(create_app(FakeEngine(), MODEL_NAME)) as live:
        url = live.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": [666], "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and r.json() == {"error": want}, r.text
        with httpx.stream("POST", url, json={"prompt": [666], "max_tokens": 2, "stream": True},
                          timeout=30) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert events[-1] == "[DONE]" and json.loads(events[-2]) == {"error": want}
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [6, 7]
    assert "ZeroDivisionError: a bug" in logged.getvalue()  # uvicorn's traceback of the full answer's


def test_a_scoring_left_running_has_its_error_retrieved(monkeypatch, caplog):
    """A request whose response ends before its prompt's scoring (here a 503: the engine died)
    leaves the scoring thread running; when it then fails, its error is retrieved, not logged
    by asyncio as "exception was never retrieved" when the task is collected."""
    import loopjax.scoring
    import loopjax.server

    release, finished = threading.Event(), threading.Event()

    def score(model, prompts, **kw):
        try:
            release.wait(20)
            raise RuntimeError("out of device memory")
        finally:
            finished.set()

    monkeypatch.setattr(loopjax.scoring, "score", score)
    monkeypatch.setattr(loopjax.scoring, "score_options", lambda *a, **kw: {})
    monkeypatch.setattr(loopjax.server, "echo_state_of", lambda model, config: None)  # scorable
    with LiveServer(create_app(FakeEngine(fail_at_step=1), MODEL_NAME)) as live:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": [4], "prompt_logprobs": 0}, timeout=30)
        assert r.status_code == 503, r.text
        release.set()
        assert finished.wait(20)
        assert httpx.get(live.url + "/health", timeout=10).status_code == 503  # the loop took the failure
        gc.collect()
    assert not [rec for rec in caplog.records if "never retrieved" in rec.getMessage()]


def test_every_sample_of_an_n_request_counts_its_ttft_from_the_request_arrival():
    """With the prefix cache on, samples 1.. are submitted once sample 0 has prefilled; their
    TTFT still counts from the request's arrival, as the client waits (it counted from their own
    submit: one step, however long sample 0 waited). Sample 0 waits >= 0.3 s here."""
    fake = FakeEngine()
    fake.scheduler = types.SimpleNamespace(config=types.SimpleNamespace(enable_prefix_caching=True,
                                                                        page_size=1))
    fake.paused = True  # sample 0 admitted, not stepped until the test lets it
    app = create_app(fake, MODEL_NAME)
    aengine = app.state.async_engine
    with LiveServer(app) as live, concurrent.futures.ThreadPoolExecutor(1) as pool:
        full = pool.submit(httpx.post, live.url + "/v1/completions", timeout=30,
                           json={"prompt": [1, 2, 3], "max_tokens": 2, "n": 2})
        deadline = time.time() + 20
        while aengine.num_waiting < 1:
            assert time.time() < deadline, "sample 0 was not admitted"
            time.sleep(0.01)
        time.sleep(0.3)
        fake.paused = False
        assert [c["token_ids"] for c in full.result().json()["choices"]] == [[4, 5], [4, 5]]
    ttft = aengine.metrics.ttft
    below = sum(n for bound, n in zip(ttft.buckets, ttft.counts) if bound <= 0.25)
    assert (ttft.count, below) == (2, 0)


def test_a_client_gone_while_its_body_is_read_is_no_bug():
    """A client that leaves mid-body (Starlette's ClientDisconnect from request.body()) was a 500
    whose traceback uvicorn logged as "Exception in ASGI application", on every POST route; it
    is a quiet 499 now (nobody reads it), as a client gone before a full answer."""
    import asyncio

    app = create_app(FakeEngine(), MODEL_NAME)

    async def post(path: str) -> list[dict]:
        sent = []

        async def receive():  # the body's first half, then the client is gone
            if not sent:
                sent.append({"type": "received"})
                return {"type": "http.request", "body": b'{"prompt": [5', "more_body": True}
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"40")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await app(scope, receive, send)  # raised ClientDisconnect after its 500
        return sent

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        sent = asyncio.run(post(path))
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499], (path, sent)
