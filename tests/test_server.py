"""The OpenAI-compatible server against the real `openai` client, live on 127.0.0.1.

One uvicorn server (in a thread, on a free port) serves the tiny Ouro preset with a small
word-level tokenizer and a ChatML template built here, prefix cache on (so the greedy-equality
test also checks the cache against `loopjax.generate` without it). `loopjax bench --url`
runs against the same server (one engine build for both). The AsyncEngine's own contract
(bounded queue, abort, a dying engine) is also checked against a fake engine whose
behaviour is exact, in-process without HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import socket
import sys
import threading
import time
import types

import httpx
import openai
import pytest
import uvicorn

from loopjax.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from loopjax.metrics import ServingMetrics, engine_stats_from_samples, parse
from loopjax.openai_protocol import APIError, render_chat
from loopjax.sampling_params import SamplingParams
from loopjax.server import create_app

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["hello", "world", "user", "assistant", "system", "the", "loop", "model"]
MODEL_NAME = "ouro-tiny"
# Small buckets keep start-up compilation short on CI's CPU: 16 rows for 16 concurrent requests.
SERVER_ENGINE = dict(max_num_rows=16, decode_row_buckets=(16,), max_prefill_tokens=64,
                     prefill_token_buckets=(64,), max_prefill_rows=4, max_logprobs=2,
                     enable_prefix_caching=True, verbose=False)
REF_ENGINE = dict(max_num_rows=2, decode_row_buckets=(2,), max_prefill_tokens=32,
                  prefill_token_buckets=(32,), max_prefill_rows=2, verbose=False)


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer: 0 <unk>, 1 <|im_start|>, 2 <|im_end|> (Ouro tiny's EOS), then words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(vocab_size - 3 - len(WORDS))]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


class LiveServer:
    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not shut down"


@pytest.fixture(scope="module")
def model():
    from loopjax.model import load

    m = load(MODEL_NAME)
    return dataclasses.replace(m, tokenizer=word_tokenizer(m.cfg.vocab_size), chat_template=CHATML)


@pytest.fixture(scope="module")
def server(model):
    from loopjax.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(**SERVER_ENGINE))
    app = create_app(engine, MODEL_NAME, model=model)
    with LiveServer(app) as live:
        live.aengine = app.state.async_engine
        yield live
    assert not live.aengine.running  # the lifespan stopped the engine thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _wait_idle(aengine, timeout_s=30):
    """Poll the engine stats until nothing runs and no page is used; returns the stats."""
    deadline = time.time() + timeout_s
    while True:
        stats = aengine.stats()
        if stats["pages_used"] == 0 and stats["running_rows"] == 0 and stats["queue_len"] == 0:
            return stats
        assert time.time() < deadline, f"engine not idle: {stats}"
        time.sleep(0.05)


# ------------------------------------------------------------------ live server
def test_completion_greedy_equals_generate(client, model):
    from loopjax.llm import generate

    prompts = [[5, 9, 13, 17, 21], [7, 3, 100, 42]]
    ref = generate(model, prompts, max_new_tokens=8, engine_options=dict(REF_ENGINE))
    for prompt, expect in zip(prompts, ref):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        choice = r.choices[0]
        assert choice.token_ids == list(expect.token_ids)
        assert choice.text == model.tokenizer.decode(list(expect.token_ids))
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(expect.token_ids)
        assert choice.finish_reason in ("length", "stop")
        assert len(choice.exit_loops) == len(choice.token_ids)


def test_text_prompt_and_batch_of_prompts(client, model):
    r = client.completions.create(model=MODEL_NAME, prompt=["hello world", "the loop model"], max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(c.token_ids) == 4 for c in r.choices)
    assert r.usage.prompt_tokens == 5


def test_chat_uses_template(client, model):
    from loopjax.llm import generate

    messages = [{"role": "system", "content": "the model"}, {"role": "user", "content": "hello world"}]
    ids = model.tokenizer.encode(render_chat(CHATML, messages), add_special_tokens=False).ids
    assert ids[:2] == [1, 7] and ids[-2:] == [1, 6]  # <|im_start|>system ... <|im_start|>assistant
    expect = generate(model, [ids], max_new_tokens=6, engine_options=dict(REF_ENGINE))[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == list(expect.token_ids)
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_completion_and_chat(client):
    kw = dict(model=MODEL_NAME, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=[4, 5, 6, 7], **kw)
    chunks = list(client.completions.create(prompt=[4, 5, 6, 7], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert ids == full.choices[0].token_ids and len(ids) == 10
    assert "".join(ch.text for c in chunks for ch in c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.submissions >= 1
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello"}],
                                               stream=True, **kw))
    assert chat[0].choices[0].delta.role == "assistant"
    assert sum(len(c.choices[0].token_ids or []) for c in chat) == 10


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and top[token] == pytest.approx(max(top.values()))  # greedy
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(content) == 3 and all(e.top_logprobs[0].token == e.token for e in content)


def test_per_request_loop_settings(client):
    kw = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    shallow = client.completions.create(**kw, extra_body={"loops": 2, "ignore_eos": True})
    assert shallow.choices[0].exit_loops == [2, 2, 2]
    with pytest.raises(openai.BadRequestError, match="loops"):
        client.completions.create(**kw, extra_body={"loops": 0})
    # Exit settings per request: Ouro Q-exit in skip mode (exits early, at most 4 loops) and an
    # exit trace replayed over the decoded tokens (the first token comes from the prompt).
    skip = client.completions.create(**kw, extra_body={"exit_mode": "skip", "exit_threshold": 0.1,
                                                       "ignore_eos": True})
    assert all(1 <= n <= 4 for n in skip.choices[0].exit_loops)
    traced = client.completions.create(**kw, extra_body={"exit_trace": [1, 2, 3], "ignore_eos": True})
    assert traced.choices[0].exit_loops[1:] == [2, 3]


def test_sixteen_concurrent_requests(client, server):
    def one(i):
        r = client.completions.create(model=MODEL_NAME, prompt=[3 + i, 4, 5 + i], max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert all(len(o) == 6 for o in outs)
    assert outs[0] == one(0)  # batch composition does not change greedy tokens
    _wait_idle(server.aengine)


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
    stats = _wait_idle(server.aengine)
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
    _wait_idle(server.aengine)


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "gpt-4", "prompt": [1, 2]}, 400, "model", "gpt-4"),
    ({"prompt": [5, 6], "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
    ({"prompt": [5, 6], "temperature": 7.5}, 400, "temperature", "temperature"),
    ({"prompt": [5] * 600}, 400, "prompt", "too long"),
    ({"prompt": [5, 999]}, 400, "prompt", "token ids"),
    ({"prompt": []}, 400, "prompt", "prompt"),
    ({"prompt": [1.5, 2]}, 400, "prompt", "integer token ids"),
    ({"prompt": [[3], 7]}, 400, "prompt", "prompt must be"),
    ({"prompt": [5], "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    ({"prompt": [5], "logprobs": 3}, 400, "logprobs", "max_logprobs"),
    ({"prompt": [5], "echo": True}, 400, "echo", "not supported"),
    ({"prompt": [5], "n": 0}, 400, "n", "n must be >= 1, got 0"),
    ({"prompt": [5], "n": 1000}, 400, "n", "n must be in [1, 16] (this server's max_n), got 1000"),
    ({"prompt": [5], "n": "x"}, 400, "n", "n must be an integer >= 1, got 'x'"),
    ({"prompt": [5], "n": 2, "best_of": 3}, 400, "best_of", "best_of must equal n (2)"),
])
def test_bad_requests_get_400(server, body, status, param, words):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]


def test_malformed_json_and_chat_errors(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="gpt-4"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2).usage.total_tokens >= 3
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_full_queue_gets_429(server, client):
    server.aengine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2)
    finally:
        server.aengine.max_waiting = 256
    assert server.aengine.metrics.rejected.value >= 1


PREFIX_METRICS = ("loopjax_prefix_cache_enabled", "loopjax_prefix_cache_hit_rate",
                  "loopjax_prefix_cache_page_hit_rate", "loopjax_prefix_cache_pages",
                  "loopjax_prefix_cache_parked_pages", "loopjax_prefix_cache_evictions_total",
                  "loopjax_prefix_cache_queried_tokens_total", "loopjax_prefix_cache_hit_tokens_total",
                  "loopjax_prefix_cache_queried_pages_total", "loopjax_prefix_cache_hit_pages_total")


def _metrics(server):
    return parse(httpx.get(server.url + "/metrics", timeout=10).text)


def test_models_and_metrics(server, client, model):
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL_NAME]
    assert cards[0].max_model_len == server.aengine.engine.scheduler.config.max_seq_len == 512
    assert cards[0].vocab_size == model.cfg.vocab_size
    client.completions.create(model=MODEL_NAME, prompt=[8, 9], max_tokens=3, temperature=0)
    samples = _metrics(server)
    for name in ("loopjax_queue_len", "loopjax_running_rows", "loopjax_pages_used", "loopjax_pages_free",
                 "loopjax_compilations", "loopjax_mean_loops_per_token", "loopjax_ttft_seconds_count",
                 "loopjax_tpot_seconds_count", 'loopjax_ttft_seconds_bucket{le="+Inf"}', *PREFIX_METRICS):
        assert name in samples, name
    assert samples["loopjax_ttft_seconds_count"] >= 1
    assert samples['loopjax_ttft_seconds_bucket{le="+Inf"}'] == samples["loopjax_ttft_seconds_count"]
    assert samples["loopjax_pages_free"] > 0 and samples["loopjax_generation_tokens_total"] >= 3


def test_prefix_cache_metrics(server, client):
    """A repeated 40-token prompt hits its 2 full pages (16 tokens each); /metrics shows the
    engine's prefix-cache counts under their Prometheus names."""
    prompt = [7 + (i * 13) % 200 for i in range(40)]
    before = _metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    _wait_idle(server.aengine)
    after = _metrics(server)
    delta = {k: after[k] - before[k] for k in PREFIX_METRICS}
    assert after["loopjax_prefix_cache_enabled"] == 1
    assert delta["loopjax_prefix_cache_queried_tokens_total"] == 80
    assert delta["loopjax_prefix_cache_hit_tokens_total"] == 32
    assert delta["loopjax_prefix_cache_queried_pages_total"] == 4
    assert delta["loopjax_prefix_cache_hit_pages_total"] == 2
    assert after["loopjax_prefix_cache_pages"] >= 2 and after["loopjax_prefix_cache_parked_pages"] >= 2
    assert after["loopjax_prefix_cache_evictions_total"] == 0  # a 512-page pool never fills here
    stats = server.aengine.stats()
    assert 0 < after["loopjax_prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hit_rate"])
    assert after["loopjax_prefix_cache_page_hit_rate"] == pytest.approx(stats["prefix_cache_page_hit_rate"])
    assert engine_stats_from_samples(after)["prefix_cache_hit_tokens"] == stats["prefix_cache_hit_tokens"]


def test_bench_over_http_sessions(server, tmp_path):
    """`loopjax bench --url` against this server: sessions whose second turns hit the first
    turns' cached page; the report's counters cover the timed run only (no other traffic)."""
    from test_bench import TINY, check_report

    from loopjax.cli import main

    out = str(tmp_path / "sessions.json")
    assert main(["bench", MODEL_NAME, "--workload", "sessions", *TINY, "-P", "20", "--url", server.url,
                 "--out", out]) == 0
    with open(out) as f:
        report = json.load(f)
    check_report(report, "sessions", 4, in_process=False)
    assert report["target"] == server.url and report["engine_stats"]["requests_finished_total"] >= 4
    # 2 sessions x 2 turns of prompts 20 and 27 tokens: each second turn hits page 0 (16 tokens).
    pc = report["prefix_cache"]
    assert pc["enabled"] is True and (pc["queried_tokens"], pc["hit_tokens"]) == (94, 32)
    assert (pc["queried_pages"], pc["hit_pages"], pc["evictions"]) == (4, 2, 0)
    assert pc["hit_rate"] == pytest.approx(32 / 94) and pc["page_hit_rate"] == 0.5
    # A name the server does not serve is one clear error line, not a traceback.
    assert main(["bench", "nope", *TINY, "--url", server.url, "--out", out]) == 1


# ------------------------------------------------------------------ n samples per prompt
def _by_index(choices) -> dict:
    return {c.index: c for c in choices}


def test_n_seeded_samples_differ_and_reproduce(client):
    """n=3 with a seed: three different samples, the same ones on a second call; sample i is
    the n=1 request with seed + i (the documented rule)."""
    kw = dict(model=MODEL_NAME, prompt=[5, 9, 13], max_tokens=8, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    first, second = (client.completions.create(n=3, **kw) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.choices]
    assert len(set(samples)) == 3 and all(len(s) == 8 for s in samples)
    assert [tuple(c.token_ids) for c in second.choices] == samples
    assert [c.text for c in second.choices] == [c.text for c in first.choices]
    assert first.usage.prompt_tokens == 3 and first.usage.completion_tokens == 24  # the prompt once
    alone = client.completions.create(n=1, **{**kw, "seed": 1236})
    assert tuple(alone.choices[0].token_ids) == samples[2]
    # Several prompts: choice p * n + i is prompt p's sample i.
    both = client.completions.create(n=2, **{**kw, "prompt": [[5, 9, 13], [7, 3]]})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [tuple(c.token_ids) for c in both.choices[:2]] == samples[:2]
    assert both.usage.prompt_tokens == 5 and both.usage.completion_tokens == 32


def test_n_greedy_choices_are_identical(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                       n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].token_ids == r.choices[1].token_ids and len(r.choices[0].token_ids) == 6
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 12


def test_n_streaming_reassembles_to_the_full_response(client):
    kw = dict(model=MODEL_NAME, n=2, max_tokens=7, temperature=0.9, seed=77, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=[4, 5, 6, 7], **kw)
    chunks = list(client.completions.create(prompt=[4, 5, 6, 7], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    parts = {0: ([], [], []), 1: ([], [], [])}  # index -> token ids, text pieces, finish reasons
    for chunk in chunks:
        for ch in chunk.choices:
            ids, text, reasons = parts[ch.index]
            ids += ch.token_ids
            text.append(ch.text)
            reasons.append(ch.finish_reason)
    for c in full.choices:
        ids, text, reasons = parts[c.index]
        assert ids == c.token_ids and "".join(text) == c.text
        assert [r for r in reasons if r] == [c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 14
    assert chunks[-1].usage.prompt_tokens == 4
    chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello"}],
                                               stream=True, **{**kw, "temperature": 0}))
    roles = {c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"}
    content = {i: "".join(c.choices[0].delta.content or "" for c in chat if c.choices[0].index == i)
               for i in (0, 1)}
    assert roles == {0, 1} and content[0] == content[1] != ""


def test_n_choices_share_the_prompt_pages(server, client):
    """A new 40-token prompt with n=3: sample 0 prefills it, samples 1 and 2 hit its 2 full
    pages (16 tokens each) in the prefix cache; sampling from cached pages changes nothing."""
    prompt = [11 + (i * 7) % 200 for i in range(40)]
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    before = _metrics(server)
    shared = client.completions.create(n=3, **kw)
    _wait_idle(server.aengine)
    after = _metrics(server)
    delta = {k.removeprefix("loopjax_prefix_cache_"): after[k] - before[k] for k in PREFIX_METRICS
             if k.endswith("_total")}
    assert (delta["queried_pages_total"], delta["hit_pages_total"], delta["hit_tokens_total"]) == (6, 4, 64)
    again = client.completions.create(n=3, **kw)  # every sample hits now: the same tokens
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in shared.choices]

def test_n_disconnect_mid_stream_aborts_every_choice(client, server):
    before = server.aengine.metrics.aborted.value
    stream = client.completions.create(model=MODEL_NAME, prompt=list(range(10, 60)), max_tokens=400, n=2,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.update(ch.index for ch in chunk.choices if ch.token_ids)
        if seen == {0, 1}:
            break
    assert server.aengine.stats()["running_rows"] == 2
    stream.close()
    stats = _wait_idle(server.aengine)
    assert stats["pages_free"] == stats["pages_total"]  # the pool is whole (parked cache pages count)
    assert server.aengine.metrics.aborted.value - before == 2


def test_chat_without_template_is_400():
    bare = types.SimpleNamespace(tokenizer=None, chat_template=None,
                                 cfg=types.SimpleNamespace(vocab_size=256, max_context_len=512))
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, model=bare)) as live:
        r = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/v1/completions", timeout=30, json={"prompt": [4, 5], "max_tokens": 3})
        assert r.json()["choices"][0]["token_ids"] == [6, 7, 8]  # the fake engine counts up


# ------------------------------------------------------------------ AsyncEngine contract (fake engine)
class FakeEngine:
    """Exact stand-in: one token per step per request (token = previous + 1), 1 page each."""

    def __init__(self, fail_at_step=None):
        self.requests, self.steps, self.fail_at_step = {}, 0, fail_at_step
        self.thread_ids = set()
        self.paused = False  # while set, the loop accepts requests but never steps
        self.gate = None  # a threading.Event step() waits for, when set

    def add_request(self, prompt_ids, params, request_id=None):
        self.thread_ids.add(threading.get_ident())
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = types.SimpleNamespace(last=prompt_ids[-1], ids=[], max=params.max_tokens)
        return request_id

    def abort(self, request_id):
        self.requests.pop(request_id)

    def has_unfinished(self):
        return bool(self.requests) and not self.paused

    def stats(self):
        return {"queue_len": 0, "running_rows": len(self.requests), "pages_used": len(self.requests),
                "pages_free": 100 - len(self.requests)}

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.steps == self.fail_at_step:
            raise RuntimeError("device fell over")
        time.sleep(0.002)
        outs = []
        for rid, r in list(self.requests.items()):
            r.last += 1
            r.ids.append(r.last)
            done = len(r.ids) == r.max
            outs.append(types.SimpleNamespace(request_id=rid, new_token_ids=[r.last], token_ids=list(r.ids),
                                              finished=done, finish_reason="length" if done else None,
                                              exit_loops=[4] * len(r.ids), logprobs=None,
                                              top_logprobs=None,
                                              metrics={"submissions": len(r.ids)}))
            if done:
                del self.requests[rid]
        return outs


def test_async_engine_contract():
    async def main():
        fake = FakeEngine()
        fake.paused = True
        aeng = AsyncEngine(fake, max_waiting=3, idle_timeout_s=0.01)
        await aeng.start()
        params = SamplingParams(max_tokens=5, temperature=0)
        with pytest.raises(ValueError, match="empty"):  # refused, nothing queued
            await aeng.submit([], params)
        streams = [await aeng.submit([10 * i], params) for i in range(1, 4)]
        with pytest.raises(QueueFullError):  # three wait for a first token already
            await aeng.submit([1], params)
        assert aeng.num_waiting == 3 and len(fake.requests) == 3
        assert not any(s.started.is_set() for s in streams)  # no output yet
        fake.paused = False
        outs = [[o async for o in s] for s in streams[:2]]
        assert streams[0].started.is_set()
        assert [o[-1].token_ids for o in outs] == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
        assert streams[0].ttft > 0 and streams[0].tpot > 0
        long = await aeng.submit([0], SamplingParams(max_tokens=10_000, temperature=0))
        await long.__anext__()
        long.close()  # abort: the fake engine drops it, its page goes back
        fake.paused = True
        queued = await aeng.submit([0], params)
        queued.close()  # aborted before any output: `started` still releases a waiter
        await asyncio.wait_for(queued.started.wait(), 1)
        assert queued.first_token_at is None
        fake.paused = False
        for _ in range(2000):  # generous: CI machines are shared
            if aeng.stats()["pages_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert aeng.stats()["pages_used"] == 0 and aeng.num_waiting == 0
        aeng.shutdown()
        assert not aeng.running and len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids

        dying = AsyncEngine(FakeEngine(fail_at_step=2))
        await dying.start()
        s = await dying.submit([1], SamplingParams(max_tokens=50, temperature=0))
        with pytest.raises(EngineDeadError, match="device fell over"):
            async for _ in s:
                pass
        with pytest.raises(EngineDeadError):
            await dying.submit([1], params)
        dying.shutdown()

        # Ctrl-C while a step runs: admissions still in the inbox are answered, never left hanging.
        slow = FakeEngine()
        slow.gate = threading.Event()
        stopping = AsyncEngine(slow)
        await stopping.start()
        first = await stopping.submit([1], params)  # accepted; the thread then blocks in step()
        for _ in range(1000):
            if slow.steps:
                break
            await asyncio.sleep(0.01)
        late = asyncio.ensure_future(stopping.submit([2], params))
        await asyncio.sleep(0.1)
        assert not late.done()
        stopping.shutdown(timeout_s=0.2)
        slow.gate.set()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await late
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in first:
                pass

    asyncio.run(asyncio.wait_for(main(), 60))


def test_metrics_text_round_trips():
    m = ServingMetrics()
    stats = {"queue_len": 2, "pages_used": 7, "custom": 1.5, "name": "x", "prefix_cache_hit_rate": 0.25,
             "prefix_cache_evictions": 3, "prefix_cache_hit_tokens": 64, "prefix_cache_pages": 9}
    m.set_engine_stats(stats)
    for v in (0.001, 0.2, 1000.0):
        m.ttft.observe(v)
    text = m.render()
    samples = parse(text)
    assert samples["loopjax_queue_len"] == 2 and samples["loopjax_engine_custom"] == 1.5
    assert samples["loopjax_prefix_cache_hit_rate"] == 0.25 and samples["loopjax_prefix_cache_pages"] == 9
    assert samples["loopjax_prefix_cache_evictions_total"] == 3
    assert "# TYPE loopjax_prefix_cache_evictions_total counter" in text
    assert "# TYPE loopjax_prefix_cache_hit_rate gauge" in text
    assert samples['loopjax_ttft_seconds_bucket{le="0.005"}'] == 1
    assert samples['loopjax_ttft_seconds_bucket{le="120"}'] == 2
    assert samples['loopjax_ttft_seconds_bucket{le="+Inf"}'] == 3
    assert samples["loopjax_ttft_seconds_sum"] > 1000
    # The client side reads the engine's stats back under their stats() keys.
    back = engine_stats_from_samples(samples)
    assert {k: back[k] for k in stats if k != "name"} == {k: v for k, v in stats.items() if k != "name"}
    assert "ttft_seconds_count" in back and not any("{" in k for k in back)
    m.set_engine_stats({"prefix_cache_evictions": 1})  # a new engine's count: a counter reset
    assert parse(m.render())["loopjax_prefix_cache_evictions_total"] == 1
    with pytest.raises(ValueError, match="line 1"):
        parse("not a sample line at all")
    assert json.dumps(samples)  # plain floats


def test_incremental_text_with_split_characters_and_stop_strings():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from loopjax.server import _Choice

    # Byte-level tokenizer without merges: "é", "ö", "✓" span two or three tokens each.
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "héllo wörld ✓ done"
    ids = tok.encode(text).ids

    def stream(stop):
        choice, deltas = _Choice(0, tok, stop), []
        for n in range(1, len(ids) + 1):
            done = n == len(ids)
            out = types.SimpleNamespace(token_ids=ids[:n], new_token_ids=ids[n - 1:n], exit_loops=[1] * n,
                                        logprobs=None, top_logprobs=None, metrics={}, finished=done,
                                        finish_reason="length" if done else None)
            deltas.append(choice.update(out)[0])
            if choice.finish_reason:
                return deltas, choice

    deltas, choice = stream(())
    assert "".join(deltas) == choice.text == text and not any("\ufffd" in d for d in deltas)
    assert choice.finish_reason == "length"
    deltas, choice = stream(("ld ✓",))  # the stop string is trimmed and never streamed
    assert "".join(deltas) == choice.text == "héllo wör" and choice.finish_reason == "stop"


def test_chatml_fallback_without_jinja2(monkeypatch):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    with_jinja = render_chat(CHATML, messages)
    for name in ("jinja2", "jinja2.exceptions", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)  # `import jinja2` now raises ImportError
    assert render_chat(CHATML, messages) == with_jinja
    with pytest.raises(APIError, match="jinja2 is not installed"):
        render_chat("{{ messages[0]['content'] }}", messages)
