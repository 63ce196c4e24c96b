"""Where a trace's device idle time sits: `python -m loopjax.bench.probes.gap_census TRACE_DIR`.

Reads a jax.profiler perfetto trace (bench/profile.py --keep-trace, bench/prefill.py --trace)
and prints, for the idle time between consecutive device kernels:
- a histogram of the gaps by size (count, total µs);
- the kernel pairs (the group of the kernel before -> after) holding the most idle time;
- the largest gaps, each with its neighbours and its traced engine step (`loopjax_step_<i>`);
- per traced step: host interval, device busy inside it, idle inside it.
The question it answers: is a step's idle time spread thinly between kernels or held by a few
places (a host sync, a copy, a launch the host is late for)?
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from loopjax.bench.trace_summary import _device_kernels, kernel_group, load_trace_events

BUCKETS_US = (1.0, 3.0, 10.0, 50.0, 200.0, float("inf"))


def census(events: list[dict], *, top: int = 15) -> dict:
    kernels, steps, _, _ = _device_kernels(events)
    kernels.sort()
    # Busy stretches with the kernel that starts each and the one that ends it (a gap's neighbours).
    stretches = []  # [start, end, first kernel, last kernel]
    for start, end, name in kernels:
        if stretches and start <= stretches[-1][1]:
            if end >= stretches[-1][1]:
                stretches[-1][1], stretches[-1][3] = end, name
        else:
            stretches.append([start, end, name, name])
    merged = [(s, e) for s, e, _, _ in stretches]
    gaps = [(b[0] - a[1], a[1], a[3], b[2]) for a, b in zip(stretches, stretches[1:])]

    def step_of(t: float):
        return next((idx for idx, s, e in steps if s <= t <= e), None)

    hist = []
    lo = 0.0
    for hi in BUCKETS_US:
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        hist.append({"from_us": lo, "to_us": hi, "count": len(sel), "total_us": sum(sel)})
        lo = hi
    pairs = defaultdict(lambda: [0, 0.0])
    for size, _, before, after in gaps:
        key = f"{kernel_group(before)} -> {kernel_group(after)}"
        pairs[key][0] += 1
        pairs[key][1] += size
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    largest = sorted(gaps, reverse=True)[:top]
    per_step = []
    for idx, s, e in sorted(steps):
        busy = sum(max(0.0, min(b, e) - max(a, s)) for a, b in merged)
        per_step.append({"step": idx, "host_us": e - s, "busy_us": busy, "idle_us": (e - s) - busy,
                         "kernels": sum(1 for a, _, _ in kernels if s <= a <= e)})
    return {"num_kernels": len(kernels), "span_us": merged[-1][1] - merged[0][0] if merged else 0.0,
            "busy_us": sum(b - a for a, b in merged), "histogram": hist,
            "pairs": [{"pair": k, "count": c, "total_us": t} for k, (c, t) in ranked],
            "largest": [{"gap_us": g, "step": step_of(t), "before": b, "after": a} for g, t, b, a in largest],
            "steps": per_step}


def format_census(c: dict) -> str:
    lines = [f"{c['num_kernels']} kernels, span {c['span_us'] / 1e3:.2f} ms, "
             f"busy {c['busy_us'] / 1e3:.2f} ms, idle {(c['span_us'] - c['busy_us']) / 1e3:.2f} ms",
             "gaps by size:"]
    lines += [f"  {h['from_us']:>6.0f}-{h['to_us']:<6.0f} µs: {h['count']:6d} gaps, "
              f"{h['total_us'] / 1e3:8.3f} ms" for h in c["histogram"]]
    lines.append("idle time by kernel pair (before -> after):")
    lines += [f"  {p['total_us'] / 1e3:8.3f} ms {p['count']:6d}x  {p['pair'][:150]}" for p in c["pairs"]]
    lines.append("largest gaps:")
    lines += [f"  {g['gap_us']:9.1f} µs step {g['step']}: {g['before'][:60]} -> {g['after'][:60]}"
              for g in c["largest"]]
    if c["steps"]:
        lines.append("per traced step (ms): host interval, device busy inside it, idle inside it, kernels")
        lines += [f"  step {s['step']:3d}: {s['host_us'] / 1e3:8.2f} {s['busy_us'] / 1e3:8.2f} "
                  f"{s['idle_us'] / 1e3:8.2f} {s['kernels']:6d}" for s in c["steps"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(format_census(census(load_trace_events(args.trace_dir), top=args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
