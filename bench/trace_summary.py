"""The device half of `python -m loopjax.bench.profile`: a `jax.profiler` perfetto trace
(Chrome-trace JSON, gz) read with the stdlib into busy time, gaps, top kernels and per-step
device time. Kernels are complete ("X") events on the "Stream ..." threads of the "/device:"
processes (H200 traces name them "Stream #14(Compute)"); rows xprof derives from them repeat
their time and are never counted.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict

STEP_PREFIX = "loopjax_step_"  # the host TraceAnnotation of each traced engine step
# Rows xprof derives from the kernels (they repeat their time): never counted as kernels.
DERIVED_ROWS = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops", "Framework Name Scope",
                "TensorFlow Ops", "TensorFlow Name Scope", "Source code", "Launch Stats")

def load_trace_events(trace_dir: str) -> list[dict]:
    """Events of the newest perfetto_trace.json.gz under trace_dir (jax.profiler.trace output)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _clipped_busy(merged, lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in merged)


def device_summary(events: list[dict], *, gap_us: float = 50.0, top: int = 15) -> dict | None:
    """Kernel time of a Chrome/perfetto trace (times in µs); None when it has no device events.

    Kernels: complete ("X") events on the "Stream ..." threads of "/device:..." processes
    other than CPUs (when no thread is named "Stream": every thread but the DERIVED_ROWS)."""
    kernels, steps, threads, streams = _device_kernels(events)
    if not kernels:
        return None
    merged = _union((s, e) for s, e, _ in kernels)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    span = merged[-1][1] - merged[0][0]
    busy = sum(e - s for s, e in merged)
    ranked = _ranked(kernels, lambda name: name, top)
    groups = _ranked(kernels, kernel_group, top)
    per_step = []
    for index, lo, hi in sorted(steps):
        inside = [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]
        step_busy = _clipped_busy(merged, lo, hi)
        per_step.append({"step": index, "wall_us": hi - lo, "device_busy_us": step_busy,
                         "busy_pct": 100.0 * step_busy / max(hi - lo, 1e-9),
                         "idle_before_first_kernel_us": inside[0][0] - lo if inside else None,
                         "idle_after_last_kernel_us": hi - inside[-1][1] if inside else None})
    return {"num_kernels": len(kernels), "device_streams": sorted(threads[k] for k in streams),
            "span_us": span, "busy_us": busy, "busy_pct": 100.0 * busy / max(span, 1e-9),
            "gaps": {"count": len(gaps), "total_us": sum(gaps), "largest_us": sorted(gaps, reverse=True)[:5],
                     "threshold_us": gap_us, "over_threshold_count": sum(g > gap_us for g in gaps),
                     "over_threshold_total_us": sum(g for g in gaps if g > gap_us)},
            "top_kernels": ranked, "top_kernel_groups": groups,
            "steps": per_step}


DECODE_ANCHOR = "paged_decode"  # the decode attention kernel: one per layer application


def kernel_positions(events: list[dict], anchor: str = DECODE_ANCHOR) -> list[dict]:
    """Device kernels by their position in the unit that each kernel named with `anchor`
    begins (a decode step's layer application): kernels of one name are told apart by their
    order since the last anchor (`name#k`: wo's and w_down's partials share a kernel). Per
    position: count, mean µs, mean idle µs before it (from the latest end of the kernels
    before), total µs of both; largest total first. [] when no kernel holds the anchor."""
    kernels = sorted(_device_kernels(events)[0])
    if not any(anchor in name for _, _, name in kernels):
        return []
    seen, stats, last_end = defaultdict(int), defaultdict(lambda: [0, 0.0, 0.0]), None
    for start, end, name in kernels:
        if anchor in name:
            seen.clear()
        label = f"{name}#{seen[name]}"
        seen[name] += 1
        entry = stats[label]
        entry[0] += 1
        entry[1] += end - start
        entry[2] += 0.0 if last_end is None else max(0.0, start - last_end)
        last_end = end if last_end is None else max(last_end, end)
    rows = [{"position": label, "count": c, "mean_us": d / c, "mean_gap_us": g / c, "total_us": d + g}
            for label, (c, d, g) in stats.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def format_positions(rows: list[dict], top: int = 16) -> str:
    lines = [f"{'count':>7}{'mean µs':>10}{'gap µs':>9}{'total ms':>10}  kernel#position in the layer"]
    lines += [f"{r['count']:>7}{r['mean_us']:>10.2f}{r['mean_gap_us']:>9.2f}{r['total_us'] / 1e3:>10.2f}  "
              f"{r['position'][:90]}" for r in rows[:top]]
    return "\n".join(lines)


def _device_kernels(events: list[dict]):
    """(kernels [(start, end, name)], host steps [(index, start, end)], thread names, the
    device "Stream" threads) of a trace: see device_summary."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}
    derived = {key for key, name in threads.items() if key[0] in devices and name in DERIVED_ROWS}
    kernels, steps = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if e["pid"] in devices:
            key = (e["pid"], e.get("tid"))
            if key in streams or not (streams or key in derived):
                kernels.append((start, end, str(e.get("name", "?"))))
        else:
            m = re.fullmatch(re.escape(STEP_PREFIX) + r"(\d+)", str(e.get("name", "")))
            if m:
                steps.append((int(m.group(1)), start, end))
    return kernels, steps, threads, streams


def kernel_group(name: str) -> str:
    """A kernel name without its numeric suffixes: `loop_add_fusion_12` -> `loop_add_fusion`
    (XLA numbers each fusion; the group shows e.g. all transposes or elementwise loops)."""
    return re.sub(r"([._]\d+)+$", "", name)


def _ranked(kernels, key, top: int) -> list[dict]:
    """The `top` names (after `key`) by total time: name, count, total and mean µs."""
    totals = defaultdict(lambda: [0, 0.0])
    for start, end, name in kernels:
        totals[key(name)][0] += 1
        totals[key(name)][1] += end - start
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "count": c, "total_us": t, "mean_us": t / c} for n, (c, t) in ranked]


def format_device_summary(s: dict, kinds: dict | None = None) -> str:
    g = s["gaps"]
    lines = [f"device: {s['num_kernels']} kernels on {len(s['device_streams']) or 'all'} stream(s), span "
             f"{s['span_us'] / 1e3:.2f} ms, busy {s['busy_us'] / 1e3:.2f} ms ({s['busy_pct']:.1f}%)",
             f"gaps: {g['count']}, total {g['total_us'] / 1e3:.2f} ms, largest "
             + ", ".join(f"{x:.0f}" for x in g["largest_us"]) + f" µs; {g['over_threshold_count']} over "
             f"{g['threshold_us']:.0f} µs totalling {g['over_threshold_total_us'] / 1e3:.2f} ms",
             f"{'total ms':>9}{'count':>7}{'mean µs':>10}  kernel"]
    lines += [f"{k['total_us'] / 1e3:>9.2f}{k['count']:>7}{k['mean_us']:>10.1f}  {k['name'][:90]}"
              for k in s["top_kernels"]]
    lines.append("kernel groups (numeric suffixes dropped):")
    lines += [f"{k['total_us'] / 1e3:>9.2f}{k['count']:>7}{k['mean_us']:>10.1f}  {k['name'][:90]}"
              for k in s["top_kernel_groups"][:8]]
    if s["steps"]:
        lines.append(f"{'step':>5} {'kind':<8}{'wall ms':>9}{'busy ms':>9}{'busy%':>7}"
                     f"{'idle before µs':>16}{'idle after µs':>15}")
        for st in s["steps"]:
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            lines.append(f"{st['step']:>5} {(kinds or {}).get(st['step'], '?'):<8}{st['wall_us'] / 1e3:>9.2f}"
                         f"{st['device_busy_us'] / 1e3:>9.2f}{st['busy_pct']:>6.1f}%"
                         f"{fmt(st['idle_before_first_kernel_us']):>16}{fmt(st['idle_after_last_kernel_us']):>15}")
    return "\n".join(lines)


def trace_runs(run, trace_dir: str, num_runs: int) -> dict:
    """Calls run() num_runs times under jax.profiler and prints the kernels per run: where
    one run's (one step's) time goes. Returns the summary with per-run counts and times
    (`per_step_count`, `per_step_us`), or {} when the trace holds no device kernels."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        for _ in range(num_runs):
            run()
    events = load_trace_events(trace_dir)
    summary = device_summary(events, top=40)
    if summary is None:
        print(f"trace: no device kernels in {trace_dir}", flush=True)
        return {}
    for ranked in (summary["top_kernels"], summary["top_kernel_groups"]):
        for k in ranked:
            k["per_step_count"], k["per_step_us"] = k["count"] / num_runs, k["total_us"] / num_runs
    print(format_device_summary(summary), flush=True)
    summary["positions"] = kernel_positions(events)
    if summary["positions"]:
        print(format_positions(summary["positions"]), flush=True)
    return summary
