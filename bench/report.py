"""Summaries of a workload run: the JSON report and its PNG plot.

`summarize(records, duration_s, ...)` returns every field of the report (REPORT_FIELDS);
percentiles are over requests (TTFT) and over requests with >= 2 tokens (TPOT), linear
interpolation; a statistic with no samples is null, never a crash.

Engine counters in a report cover the timed run only: they are the difference of the
engine's stats after and before it (the untimed warm-up request is outside), so
`prefix_cache` hit rates are those of the workload's own requests and
`compilations_during_run` must be 0 on a warm engine. `compare_prefix_cache(off, on)` puts
two reports of one workload side by side with their on/off ratios (`--compare-prefix-cache`).
matplotlib is optional: without it the plot writers return None.
"""

from __future__ import annotations

import json
import math
import os

REPORT_FIELDS = (
    "workload", "model", "target", "spec", "num_requests", "duration_s", "prompt_tokens",
    "output_tokens", "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
    "submissions_per_output_token", "mean_loops_per_token", "prefix_cache", "load_s", "warmup_s",
    "compilations_after_warmup", "compile_times", "compilations_during_run", "truncated",
    "cut_output_tokens", "engine_stats", "requests",
)
PREFIX_CACHE_FIELDS = (
    "enabled", "hit_rate", "page_hit_rate", "hit_tokens", "queried_tokens", "hit_pages", "queried_pages",
    "evictions", "cached_pages", "parked_pages",
)
COMPARE_FIELDS = ("compare", "off", "on", "ratio", "matching_outputs")
RATIO_FIELDS = ("tokens_per_s", "ttft_p50_s", "tpot_p50_s", "prefix_cache_hit_rate")


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def prefix_cache_summary(before: dict, after: dict, enabled: bool | None) -> dict:
    """Prefix-cache counts of a run from the engine stats around it (PREFIX_CACHE_FIELDS).
    Hit rates: hit / queried over the run's admissions (0.0 with the cache off; None when
    nothing was queried with the cache on or unknown); `cached_pages`/`parked_pages`: after it."""
    def delta(key):
        if key not in after:
            return None
        return int(after[key] - before.get(key, 0))

    def rate(hit, queried):
        if hit is not None and queried:
            return hit / queried
        return 0.0 if enabled is False else None

    hit_tokens, queried_tokens = delta("prefix_cache_hit_tokens"), delta("prefix_cache_queried_tokens")
    hit_pages, queried_pages = delta("prefix_cache_hit_pages"), delta("prefix_cache_queried_pages")
    now = {k: None if after.get(k) is None else int(after[k])
           for k in ("prefix_cache_pages", "prefix_cache_parked_pages")}
    return {"enabled": enabled, "hit_rate": rate(hit_tokens, queried_tokens),
            "page_hit_rate": rate(hit_pages, queried_pages), "hit_tokens": hit_tokens,
            "queried_tokens": queried_tokens, "hit_pages": hit_pages, "queried_pages": queried_pages,
            "evictions": delta("prefix_cache_evictions"), "cached_pages": now["prefix_cache_pages"],
            "parked_pages": now["prefix_cache_parked_pages"]}


def summarize(records, duration_s: float, *, workload: str, model: str, target: str, spec: dict,
              engine_stats: dict | None = None, mean_loops_per_token: float | None = None,
              stats_before: dict | None = None, prefix_caching: bool | None = None,
              startup: dict | None = None, truncated: bool = False, cut_tokens: int = 0) -> dict:
    """The report dict. `mean_loops_per_token` defaults to the mean of the records' exit loops.
    `engine_stats` / `stats_before`: the engine's stats after / before the timed run;
    `prefix_caching`: whether the engine had the cache on (None: unknown); `startup`: load_s,
    warmup_s, compilations_after_warmup, compile_times (in-process); `truncated`: --max-seconds
    cut the run; `cut_tokens`: the tokens its cut requests had received (in tokens_per_s: the
    duration covers their time too)."""
    output_tokens = sum(len(r.token_ids) for r in records)
    subs = sum(r.submissions for r in records)
    loops = [x for r in records for x in r.exit_loops]
    if mean_loops_per_token is None and loops:
        mean_loops_per_token = sum(loops) / len(loops)
    after, before, startup = engine_stats or {}, stats_before or {}, startup or {}
    compiled = None
    if "compilations" in after and "compilations" in before:
        compiled = int(after["compilations"] - before["compilations"])
    report = {
        "workload": workload,
        "model": model,
        "target": target,  # "in-process" or the server URL
        "spec": spec,
        "num_requests": len(records),
        "duration_s": duration_s,
        "prompt_tokens": sum(r.prompt_len for r in records),
        "output_tokens": output_tokens,
        "tokens_per_s": (output_tokens + cut_tokens) / duration_s if duration_s > 0 else None,
        "ttft_p50_s": percentile([r.ttft for r in records], 50),
        "ttft_p90_s": percentile([r.ttft for r in records], 90),
        "tpot_p50_s": percentile([r.tpot for r in records], 50),
        "submissions_per_output_token": subs / output_tokens if subs and output_tokens else None,
        "mean_loops_per_token": mean_loops_per_token,
        "prefix_cache": prefix_cache_summary(before, after, prefix_caching),
        "load_s": startup.get("load_s"),  # model load (in-process; None over HTTP)
        "warmup_s": startup.get("warmup_s"),  # Engine construction: pool + compiling every bucket
        "compilations_after_warmup": startup.get("compilations_after_warmup"),
        # every executable built at start-up, slowest first: shapes, kind, lower_s, compile_s,
        # cache_hit (persistent compilation cache), label, seconds (in-process; None over HTTP)
        "compile_times": startup.get("compile_times"),
        "compilations_during_run": compiled,  # compiles in the timed run: must be 0
        "truncated": bool(truncated),  # the --max-seconds budget cut the run (finished requests only)
        "cut_output_tokens": cut_tokens,  # received by the requests it cut (counted in tokens_per_s)
        "engine_stats": after,
        "requests": [{"session": r.session, "turn": r.turn, "prompt_len": r.prompt_len,
                      "output_len": len(r.token_ids), "start_s": r.start, "ttft_s": r.ttft,
                      "tpot_s": r.tpot, "end_s": r.end, "submissions": r.submissions}
                     for r in records],
    }
    return report


# The sampling fields' values that leave greedy decoding alone (the summary names the others).
_SAMPLING_OFF = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "frequency_penalty": 0.0, "presence_penalty": 0.0}


def format_summary(report: dict) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.1f} ms"

    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    cut = report.get("cut_output_tokens")
    text = (f"{report['workload']} on {report['model']} ({report['target']}): "
            f"{report['num_requests']} requests, {report['output_tokens']} tokens"
            + (f" (+{cut} of cut requests)" if cut else "") + " in "
            f"{report['duration_s']:.2f} s = {num(report['tokens_per_s'], '.1f')} tok/s | "
            f"TTFT p50 {ms(report['ttft_p50_s'])} p90 {ms(report['ttft_p90_s'])} | "
            f"TPOT p50 {ms(report['tpot_p50_s'])} | "
            f"submissions/token {num(report['submissions_per_output_token'], '.2f')} | "
            f"loops/token {num(report['mean_loops_per_token'], '.2f')}")
    drawn = {k: v for k, v in ((report.get("spec") or {}).get("sampling") or {}).items()
             if v != _SAMPLING_OFF.get(k)}
    if drawn:
        text += " | " + " ".join(f"{k}={v}" for k, v in drawn.items())
    pc = report.get("prefix_cache") or {}
    if pc.get("enabled") or pc.get("queried_tokens"):
        text += (f" | prefix cache hit {pct(pc['hit_rate'])} of tokens, {pct(pc['page_hit_rate'])} of "
                 f"pages, {num(pc['evictions'], 'd')} evictions")
    elif pc.get("enabled") is False:
        text += " | prefix cache off"
    if report.get("warmup_s") is not None:
        text += (f" | warm-up {report['warmup_s']:.1f} s, {num(report['compilations_after_warmup'], 'd')} "
                 f"compilations")
    if report.get("compilations_during_run") is not None:
        text += f" | {report['compilations_during_run']} compilations in the run"
    if report.get("truncated"):
        text += " | TRUNCATED by --max-seconds"
    return text


def format_compile_times(times: list[dict], top: int = 3) -> str:
    """The `top` slowest executables of a report's compile_times (slowest first), one line."""
    hits = sum(t["cache_hit"] for t in times)
    head = f"{len(times)} executables, {sum(t['seconds'] for t in times):.1f} s summed over compile threads"
    if hits:
        head += f" ({hits} from the compilation cache)"
    slowest = ", ".join(f"{t['label']} {t['seconds']:.1f} s (lower {t['lower_s']:.1f})" for t in times[:top])
    return f"{head}; slowest: {slowest}"


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ratio(a, b):
    return None if a is None or not b else a / b


def compare_prefix_cache(off: dict, on: dict, off_outputs=None, on_outputs=None) -> dict:
    """Two reports of one workload, cache off and on: both, the on/off ratios (RATIO_FIELDS;
    the hit rate's is None while the cache-off rate is 0) and `matching_outputs`, the fraction
    of requests whose output tokens agree (lists of token lists in the same order; None
    when not given). An arm that did not run (--max-seconds) is None, and so are the ratios."""
    if off is None or on is None:
        return {"compare": "prefix_cache", "off": off, "on": on, "ratio": dict.fromkeys(RATIO_FIELDS),
                "matching_outputs": None}
    ratio = {k: _ratio(on[k], off[k]) for k in RATIO_FIELDS[:3]}
    ratio["prefix_cache_hit_rate"] = _ratio(on["prefix_cache"]["hit_rate"], off["prefix_cache"]["hit_rate"])
    matching = None
    if off_outputs is not None and on_outputs is not None and len(off_outputs) == len(on_outputs):
        matching = sum(a == b for a, b in zip(off_outputs, on_outputs)) / max(1, len(off_outputs))
    return {"compare": "prefix_cache", "off": off, "on": on, "ratio": ratio, "matching_outputs": matching}


def format_compare(result: dict) -> str:
    """A table of the cache-off and cache-on runs and their ratio."""
    off, on, ratio = result["off"], result["on"], result["ratio"]
    if off is None or on is None:
        ran = "on" if off is None else "off"
        return f"prefix cache off vs on: only the cache-{ran} run had time (--max-seconds)"

    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.1f} ms"

    def times(x):
        return "-" if x is None else f"{x:.2f}x"

    def count(x):
        return "n/a" if x is None else str(x)

    rows = [("tokens/s", *(("n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}")
                           for r in (off, on)), times(ratio["tokens_per_s"])),
            ("TTFT p50", ms(off["ttft_p50_s"]), ms(on["ttft_p50_s"]), times(ratio["ttft_p50_s"])),
            ("TPOT p50", ms(off["tpot_p50_s"]), ms(on["tpot_p50_s"]), times(ratio["tpot_p50_s"])),
            ("hit rate (tokens)", pct(off["prefix_cache"]["hit_rate"]), pct(on["prefix_cache"]["hit_rate"]),
             times(ratio["prefix_cache_hit_rate"])),
            ("hit rate (pages)", pct(off["prefix_cache"]["page_hit_rate"]),
             pct(on["prefix_cache"]["page_hit_rate"]), "-"),
            ("evictions", *(count(r["prefix_cache"]["evictions"]) for r in (off, on)), "-"),
            ("compilations in run", *(count(r["compilations_during_run"]) for r in (off, on)), "-")]
    head = (f"prefix cache off vs on: {on['workload']} on {on['model']} ({on['target']}), "
            f"{on['num_requests']} requests; matching outputs {pct(result['matching_outputs'])}")
    if off["truncated"] or on["truncated"]:
        head += " (TRUNCATED by --max-seconds)"
    lines = [head, f"{'':<20}{'off':>14}{'on':>14}{'on/off':>10}"]
    lines += [f"{name:<20}{a:>14}{b:>14}{r:>10}" for name, a, b, r in rows]
    return "\n".join(lines)


def write_json(report: dict, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _pyplot():
    """matplotlib's pyplot (Agg), or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plot(report: dict, path: str) -> str | None:
    """Three panels: TTFT CDF, TPOT CDF, output tokens finished over time. Returns the path
    (None without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None

    reqs = report["requests"]
    t0 = min((r["start_s"] for r in reqs), default=0.0)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        xs = sorted(r[key] * 1e3 for r in reqs if r[key] is not None)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    done = sorted((r["end_s"] - t0, r["output_len"]) for r in reqs)
    total, ts, cum = 0, [], []
    for t, n in done:
        total += n
        ts.append(t)
        cum.append(total)
    axes[2].plot(ts, cum)
    axes[2].set(title="output tokens (finished requests)", xlabel="s", ylabel="tokens")
    axes[2].grid(alpha=0.3)
    fig.suptitle(format_summary(report), fontsize=8)
    return _save(fig, plt, path)


def write_sweep_plot(reports: list[dict], path: str) -> str | None:
    """A burst sweep: tokens/s, TTFT p50/p90 and TPOT p50 against the concurrency C."""
    plt = _pyplot()
    if plt is None:
        return None

    cs = [r["spec"]["concurrency"] for r in reports]

    def series(key, scale=1.0):
        return [None if r[key] is None else r[key] * scale for r in reports]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(cs, series("tokens_per_s"), "o-")
    axes[0].set(title="throughput", ylabel="output tokens/s")
    axes[1].plot(cs, series("ttft_p50_s", 1e3), "o-", label="p50")
    axes[1].plot(cs, series("ttft_p90_s", 1e3), "o--", label="p90")
    axes[1].set(title="TTFT", ylabel="ms")
    axes[1].legend()
    axes[2].plot(cs, series("tpot_p50_s", 1e3), "o-")
    axes[2].set(title="TPOT p50", ylabel="ms")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests C")
        ax.grid(alpha=0.3)
    fig.suptitle(f"burst sweep on {reports[0]['model']} ({reports[0]['target']})", fontsize=9)
    return _save(fig, plt, path)


# Fields of a decode_step record that tell its experiments apart (besides preset and context).
STEP_VARIANT_KEYS = ("page_width", "backend", "matmul", "pointwise", "streaming_extra", "mosaic", "layout",
                     "attn_write", "attn_splits", "attn_stages", "attn_heads", "loops", "max_logprobs")


def write_steps_plot(records: list[dict], path: str) -> str | None:
    """Decode steps (bench/decode_step.py records): tokens/s and % of the bandwidth roofline
    against rows, one line per (preset, context, experiment) of the fused pipelined steps; a
    label names the STEP_VARIANT_KEYS whose values differ within a (preset, context)."""
    plt = _pyplot()
    if plt is None:
        return None
    fused = [r for r in records if r["variant"] == "fused" and r.get("pipelined_us")]
    keys = [k for k in STEP_VARIANT_KEYS  # those that differ within a (preset, context)
            if len({(r["preset"], r["context"], str(r.get(k))) for r in fused})
            > len({(r["preset"], r["context"]) for r in fused})]
    lines: dict[tuple, list] = {}
    for r in fused:
        lines.setdefault((r["preset"], r["context"], *(str(r.get(k)) for k in keys)), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (preset, context, *values), rs in lines.items():
        rs = sorted(rs, key=lambda r: r["rows"])
        rows = [r["rows"] for r in rs]
        label = ", ".join([preset, f"context {context}", *(f"{k} {v}" for k, v in zip(keys, values))])
        axes[0].plot(rows, [r["rows"] / r["pipelined_us"] * 1e6 for r in rs], "o-", label=label)
        axes[1].plot(rows, [r["pipelined_roofline_pct"] for r in rs], "o-", label=label)
    axes[0].set(title="decode throughput (pipelined steps)", ylabel="output tokens/s")
    axes[1].set(title="% of the bandwidth roofline", ylabel="%")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


def write_compare_plot(result: dict, path: str) -> str | None:
    """Cache off vs on: tokens/s, TTFT p50, TPOT p50 and hit rate as bar pairs."""
    plt = _pyplot()
    if plt is None:
        return None
    off, on = result["off"], result["on"]
    panels = (("throughput (tokens/s)", "tokens_per_s", 1.0), ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
              ("TPOT p50 (ms)", "tpot_p50_s", 1e3), ("hit rate (% of tokens)", None, 100.0))
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, (title, key, scale) in zip(axes, panels):
        values = [(r[key] if key else r["prefix_cache"]["hit_rate"]) for r in (off, on)]
        ax.bar(["off", "on"], [0.0 if v is None else v * scale for v in values], color=["0.6", "C0"])
        ax.set(title=title, xlabel="prefix cache")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"prefix cache off vs on: {on['workload']} on {on['model']} ({on['target']}), "
                 f"{on['num_requests']} requests", fontsize=9)
    return _save(fig, plt, path)
