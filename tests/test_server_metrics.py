"""/v1/models, /metrics (Prometheus text, prefix-cache counters), `loopjax bench --url`
against the live server, and the metrics text format itself."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest
from server_helpers import MODEL_NAME, PREFIX_METRICS, scrape_metrics, wait_idle

from loopjax.metrics import ServingMetrics, engine_stats_from_samples, parse


def test_models_and_metrics(server, client, served_model):
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL_NAME]
    assert cards[0].max_model_len == server.aengine.engine.scheduler.config.max_seq_len == 512
    assert cards[0].vocab_size == served_model.cfg.vocab_size
    assert cards[0].created > 1.7e9 and cards[0].root == MODEL_NAME  # a preset: its name (created was 0)
    permission = cards[0].permission[0]  # vLLM's one permission object (the card had none)
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    client.completions.create(model=MODEL_NAME, prompt=[8, 9], max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = check_exposition(text)
    # The engine's counts since start are counters (they were gauges without _total).
    for name in ("compilations", "steps", "decode_steps", "prefill_steps", "preemptions", "submissions"):
        assert f"# TYPE loopjax_{name}_total counter" in text, name
    for name in ("loopjax_queue_len", "loopjax_running_rows", "loopjax_pages_used", "loopjax_pages_free",
                 "loopjax_compilations_total", "loopjax_steps_total", "loopjax_preemptions_total",
                 "loopjax_mean_loops_per_token", "loopjax_ttft_seconds_count",
                 "loopjax_tpot_seconds_count", 'loopjax_ttft_seconds_bucket{le="+Inf"}', *PREFIX_METRICS):
        assert name in samples, name
    assert samples["loopjax_ttft_seconds_count"] >= 1
    wait_idle(server.aengine)
    idle = scrape_metrics(server)  # every finished request's latency counts with it
    assert idle["loopjax_e2e_request_latency_seconds_count"] == idle["loopjax_requests_finished_total"]
    assert samples['loopjax_ttft_seconds_bucket{le="+Inf"}'] == samples["loopjax_ttft_seconds_count"]
    assert samples["loopjax_pages_free"] > 0 and samples["loopjax_generation_tokens_total"] >= 3


def test_prefix_cache_metrics(server, client):
    """A repeated 40-token prompt hits its 2 full pages (16 tokens each); /metrics shows the
    engine's prefix-cache counts under their Prometheus names."""
    prompt = [7 + (i * 13) % 200 for i in range(40)]
    before = scrape_metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_idle(server.aengine)
    after = scrape_metrics(server)
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
                 "--temperature", "0.9", "--frequency-penalty", "0.4", "--sampling-seed", "5",
                 "--out", out]) == 0
    with open(out) as f:
        report = json.load(f)
    check_report(report, "sessions", 4, in_process=False)  # drawn, with ignore_eos: 4 tokens each
    assert report["spec"]["sampling"]["frequency_penalty"] == 0.4
    assert report["target"] == server.url and report["engine_stats"]["requests_finished_total"] >= 4
    # 2 sessions x 2 turns of prompts 20 and 27 tokens: each second turn hits page 0 (16 tokens).
    pc = report["prefix_cache"]
    assert pc["enabled"] is True and (pc["queried_tokens"], pc["hit_tokens"]) == (94, 32)
    assert (pc["queried_pages"], pc["hit_pages"], pc["evictions"]) == (4, 2, 0)
    assert pc["hit_rate"] == pytest.approx(32 / 94) and pc["page_hit_rate"] == 0.5
    # A name the server does not serve is one clear error line, not a traceback (exit 2: a refusal).
    assert main(["bench", "nope", *TINY, "--url", server.url, "--out", out]) == 2


def check_exposition(text: str) -> dict[str, float]:
    """Prometheus text format 0.0.4 as a scraper reads it: each family's HELP and TYPE once, before
    its samples; counters named *_total; a histogram's buckets cumulative up to le="+Inf", which
    equals its _count; no NaN. -> the parsed samples."""
    samples, types, seen = parse(text), {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in seen, f"HELP of {name} twice"
            seen.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name in seen and name not in types, f"TYPE of {name} without HELP or twice"
            types[name] = kind
        else:
            family = re.sub(r"(_bucket|_sum|_count)$", "", line.split("{")[0].split()[0])
            assert family in types or line.split()[0] in types, f"sample before its TYPE: {line}"
    for name, kind in types.items():
        assert kind != "counter" or name.endswith("_total"), f"counter {name} lacks _total"
        if kind == "histogram":
            buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket{")]
            assert buckets == sorted(buckets) and buckets[-1] == samples[f"{name}_count"]
            assert f'{name}_bucket{{le="+Inf"}}' in samples
    assert not any(math.isnan(v) for v in samples.values())
    return samples


def test_metrics_text_round_trips():
    m = ServingMetrics()
    stats = {"queue_len": 2, "pages_used": 7, "custom": 1.5, "name": "x", "prefix_cache_hit_rate": 0.25,
             "prefix_cache_evictions": 3, "prefix_cache_hit_tokens": 64, "prefix_cache_pages": 9}
    m.set_engine_stats(stats)
    for v in (0.001, 0.2, 1000.0):
        m.ttft.observe(v)
    text = m.render()
    samples = check_exposition(text)
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


def test_help_texts_and_label_values_are_escaped():
    """The exposition format escapes a backslash and a newline in HELP lines, and a double quote
    too in label values: a raw newline in a HELP broke the exposition into a bad line."""
    from loopjax.metrics import _sample

    m = ServingMetrics()
    m.registry.gauge("loopjax_odd_help", 'a \\ b\nc "q"')
    m.set_engine_stats({"odd\nkey": 1})  # a new stats key: its HELP quotes the key
    lines = m.render().splitlines()
    assert r'# HELP loopjax_odd_help a \\ b\nc "q"' in lines
    assert r"# HELP loopjax_engine_odd_key engine stats()['odd\\nkey']" in lines
    assert check_exposition("\n".join(lines))["loopjax_engine_odd_key"] == 1
    assert _sample("m", 2, {"le": 'a"b\\c\nd'}) == r'm{le="a\"b\\c\nd"} 2'
