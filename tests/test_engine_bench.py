"""The decode-step benchmark runs end to end on CPU (tiny preset) and reports sane records."""

import json

from loopjax.bench import decode_step


def test_decode_step_smoke(tmp_path):
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--out", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["variant"], r["rows"], r["submissions_per_token"]) for r in records] == [
        ("fused", 2, 1), ("per_loop", 2, 4)]
    for r in records:
        assert r["median_us"] > 0 and r["weight_bytes"] > 0 and r["kv_bytes"] > 0
        assert 0 < r["roofline_pct"] < 100
