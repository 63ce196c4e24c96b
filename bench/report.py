"""Summaries of a workload run: the JSON report and its PNG plot.

`summarize(records, duration_s, ...)` returns every field of the report (REPORT_FIELDS);
percentiles are over requests (TTFT) and over requests with >= 2 tokens (TPOT), linear
interpolation; a statistic with no samples is null, never a crash.
"""

from __future__ import annotations

import json
import math
import os

REPORT_FIELDS = (
    "workload", "model", "target", "spec", "num_requests", "duration_s", "prompt_tokens",
    "output_tokens", "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
    "submissions_per_output_token", "mean_loops_per_token", "engine_stats", "requests",
)


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records, duration_s: float, *, workload: str, model: str, target: str, spec: dict,
              engine_stats: dict | None = None, mean_loops_per_token: float | None = None) -> dict:
    """The report dict. `mean_loops_per_token` defaults to the mean of the records' exit loops."""
    output_tokens = sum(len(r.token_ids) for r in records)
    subs = sum(r.submissions for r in records)
    loops = [x for r in records for x in r.exit_loops]
    if mean_loops_per_token is None and loops:
        mean_loops_per_token = sum(loops) / len(loops)
    report = {
        "workload": workload,
        "model": model,
        "target": target,  # "in-process" or the server URL
        "spec": spec,
        "num_requests": len(records),
        "duration_s": duration_s,
        "prompt_tokens": sum(r.prompt_len for r in records),
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "ttft_p50_s": percentile([r.ttft for r in records], 50),
        "ttft_p90_s": percentile([r.ttft for r in records], 90),
        "tpot_p50_s": percentile([r.tpot for r in records], 50),
        "submissions_per_output_token": subs / output_tokens if subs and output_tokens else None,
        "mean_loops_per_token": mean_loops_per_token,
        "engine_stats": engine_stats or {},
        "requests": [{"session": r.session, "turn": r.turn, "prompt_len": r.prompt_len,
                      "output_len": len(r.token_ids), "start_s": r.start, "ttft_s": r.ttft,
                      "tpot_s": r.tpot, "end_s": r.end, "submissions": r.submissions}
                     for r in records],
    }
    return report


def format_summary(report: dict) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.1f} ms"

    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    return (f"{report['workload']} on {report['model']} ({report['target']}): "
            f"{report['num_requests']} requests, {report['output_tokens']} tokens in "
            f"{report['duration_s']:.2f} s = {num(report['tokens_per_s'], '.1f')} tok/s | "
            f"TTFT p50 {ms(report['ttft_p50_s'])} p90 {ms(report['ttft_p90_s'])} | "
            f"TPOT p50 {ms(report['tpot_p50_s'])} | "
            f"submissions/token {num(report['submissions_per_output_token'], '.2f')} | "
            f"loops/token {num(report['mean_loops_per_token'], '.2f')}")


def write_json(report: dict, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def write_plot(report: dict, path: str):
    """Three panels: TTFT CDF, TPOT CDF, output tokens finished over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_sweep_plot(reports: list[dict], path: str):
    """A burst sweep: tokens/s, TTFT p50/p90 and TPOT p50 against the concurrency C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
