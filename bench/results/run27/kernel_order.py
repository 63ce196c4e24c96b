"""Run 27 probe: per-position kernel times in a traced decode step. Kernels of one name that
run several times per layer application (wo's and w_down's partials share a kernel) are told
apart by their order since the last attention kernel; for each position: count, mean duration,
and the mean idle gap before it (the previous kernel's end to its start).
Usage: python kernel_order.py TRACE_DIR"""
import sys
from collections import defaultdict

from loopjax.bench.trace_summary import load_trace_events

events = load_trace_events(sys.argv[1])
procs = {e["pid"]: str(e["args"].get("name", "")) for e in events
         if e.get("ph") == "M" and e.get("name") == "process_name"}
threads = {(e["pid"], e.get("tid")): str(e["args"].get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "thread_name"}
devs = {p for p, n in procs.items() if n.startswith("/device:") and "CPU" not in n}
ks = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e["name"])) for e in events
            if e.get("ph") == "X" and "dur" in e and e["pid"] in devs
            and threads.get((e["pid"], e.get("tid")), "").startswith("Stream"))
seen, stats, prev_end = defaultdict(int), defaultdict(lambda: [0, 0.0, 0.0]), None
for start, end, name in ks:
    if "paged_decode" in name:
        seen.clear()
    label = f"{name[:60]}#{seen[name]}"
    seen[name] += 1
    s = stats[label]
    s[0] += 1
    s[1] += end - start
    s[2] += 0.0 if prev_end is None else max(0.0, start - prev_end)
    prev_end = end
total = sum(v[1] for v in stats.values()) + sum(v[2] for v in stats.values())
print(f"{len(ks)} kernels, busy+gaps {total / 1e3:.2f} ms")
print(f"{'count':>6}{'mean us':>9}{'gap us':>8}{'total ms':>9}  kernel#position")
for label, (c, d, g) in sorted(stats.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
    if (d + g) / total > 0.002:
        print(f"{c:>6}{d / c:>9.2f}{g / c:>8.2f}{(d + g) / 1e3:>9.2f}  {label}")
