"""Failures while serving: a cancelled stream or a vanished client aborts its requests and
frees their pages, a full queue answers 429; after each the server keeps serving."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_helpers import MODEL_NAME, wait_idle


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
    server.aengine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model=MODEL_NAME, prompt=[5, 6], max_tokens=2)
    finally:
        server.aengine.max_waiting = 256
    assert server.aengine.metrics.rejected.value >= 1
