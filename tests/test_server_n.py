"""`n` samples per prompt on the live server: seeded samples differ and reproduce (sample i
is seed + i), greedy ones are identical, streams reassemble per choice index, samples share
the prompt's cached pages, and a disconnect aborts every choice."""

from __future__ import annotations

from server_helpers import MODEL_NAME, PREFIX_METRICS, scrape_metrics, wait_idle


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
    before = scrape_metrics(server)
    shared = client.completions.create(n=3, **kw)
    wait_idle(server.aengine)
    after = scrape_metrics(server)
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
    stats = wait_idle(server.aengine)
    assert stats["pages_free"] == stats["pages_total"]  # the pool is whole (parked cache pages count)
    assert server.aengine.metrics.aborted.value - before == 2


def test_n_adaptive_samples_start_together(server, client, monkeypatch):
    """Adaptive exits neither look up nor publish cached pages (prefix_cache.py): the samples of
    a skip-mode request are admitted together (they waited for sample 0's first token, to share
    nothing, then queued behind the requests that came meanwhile); plain ones still wait."""
    aengine, seen = server.aengine, []
    submit_all = aengine.submit_all

    async def recording(jobs, **kwargs):
        seen.extend([aengine.metrics.ttft.count] * len(jobs))  # first outputs so far
        return await submit_all(jobs, **kwargs)

    monkeypatch.setattr(aengine, "submit_all", recording)
    kw = dict(model=MODEL_NAME, prompt=[17 + (i * 5) % 200 for i in range(40)], n=3, max_tokens=3,
              temperature=1.0, seed=2)
    assert len(client.completions.create(**kw, extra_body={"ignore_eos": True}).choices) == 3
    assert len(seen) == 3 and seen[1] == seen[2] == seen[0] + 1  # samples 1, 2 after sample 0's output
    seen.clear()
    skip = {"exit_mode": "skip", "exit_threshold": 0.1, "ignore_eos": True}
    assert len(client.completions.create(**kw, extra_body=skip).choices) == 3
    assert len(seen) == 3 and len(set(seen)) == 1
    wait_idle(server.aengine)
