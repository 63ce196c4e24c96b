"""Shared pieces of the device benchmarks (adaptive.py, decode_step.py, prefill.py): argument
lists, the median timer, the wall-clock budget, the decode KV pool, the JSON writer, the
`main()` / --smoke pattern and `patched` (an experiment's module settings). No measurement
lives here; each script keeps its own records."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time

import jax


def ints(text: str) -> list[int]:
    return [int(t) for t in str(text).split(",") if t.strip()]


def names(text: str, none: bool = False) -> list[str]:
    """Comma-separated names; with `none`, '' or 'none' give no names."""
    return [t.strip() for t in str(text).split(",") if t.strip() and not (none and t.strip() == "none")]


TILE_SPEC_KEYS = dict(n="block_n", k="block_k", s="split_k", t="num_stages")


def tile_spec(spec: str) -> dict[str, int]:
    """A probe arm's tiling after its '@' ('n64k128s2t4': block_n 64, block_k 128, split_k 2,
    4 stages; any subset, any order) as keyword arguments; other text in it is ignored."""
    return {TILE_SPEC_KEYS[key]: int(value) for key, value in re.findall(r"([nkst])(\d+)", spec)}


def error_text(e: BaseException, limit: int = 300) -> str:
    return f"{type(e).__name__}: {str(e)[:limit]}"


def default_dtype(preset: str, dtype: str | None) -> str:
    """--dtype, else bf16 (fp32 for tiny presets)."""
    return dtype or ("float32" if preset.endswith("-tiny") else "bfloat16")


def time_calls(fn, iters: int) -> list[float]:
    """Seconds of each of `iters` calls of `fn` after one warm-up call (it compiles),
    block_until_ready each."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def pipelined_us(fn, iters: int = 50) -> float:
    """Microseconds per call of `fn` over `iters` calls submitted back to back with one wait
    at the end (after one warm-up call): device time once dispatch overlaps the calls."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e6


class Budget:
    """Wall-clock budget: a case starts only if the longest case of its kind so far fits."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()
        self.longest: dict = {}  # kind -> longest seconds so far
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, what: str, kind, factor: float = 1.0) -> bool:
        if self.elapsed() + factor * self.longest.get(kind, 0.0) <= self.seconds:
            return True
        self.skipped.append(what)
        return False

    def spent(self, kind, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def report_done(self) -> None:
        print(f"done in {self.elapsed():.1f} s" + (f"; skipped for time: {', '.join(self.skipped)}"
                                                   if self.skipped else ""), flush=True)


def run_interruptible(body, state: dict) -> None:
    """body(); gpu_run.sh's timeout sends SIGINT: keep what was measured."""
    try:
        body()
    except KeyboardInterrupt:
        state["interrupted"] = True
        print("interrupted: writing what was measured", flush=True)


@contextlib.contextmanager
def patched(module, **values):
    """An experiment of a benchmark only: module.<name> = value for each keyword while the
    block runs (a module table or rule read when a step is traced), restored after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def decode_pool(model, layout_kind: str, page_size: int, loops: int, max_rows: int,
                context: int, kv_gb: float):
    """(layout, pages_per_row, num_pages) of a KV pool whose page tables cover `context`
    positions per row, capped at `kv_gb` (rows then wrap around it: decode_rows)."""
    from loopjax import kv_cache
    pages_per_row = -(-context // page_size)
    probe = kv_cache.make_layout(model.cfg, layout_kind, page_size=page_size, dtype=model.dtype,
                                 num_pages=1, max_loops=loops)
    cap = int(kv_gb * 1e9) // (probe.bytes_per_token * page_size)
    num_pages = max(pages_per_row, min(max_rows * pages_per_row, cap))
    layout = kv_cache.make_layout(model.cfg, layout_kind, page_size=page_size, dtype=model.dtype,
                                  num_pages=num_pages, max_loops=loops)
    return layout, pages_per_row, num_pages


def decode_rows(rows: int, pages_per_row: int, num_pages: int, context: int, loops: int):
    """One decode token per row at position context - 1; rows wrap around a small pool."""
    from loopjax.batch import greedy_row
    return [greedy_row([1], context - 1, [(r * pages_per_row + j) % num_pages
                                          for j in range(pages_per_row)], loops=loops, carry_slot=r)
            for r in range(rows)]


def make_cli(prog: str, doc: str, add_arguments, run, smoke: dict):
    """(parser, main) of a benchmark: `main(argv)` parses, applies `smoke` (--smoke) to every
    option the command line left at its default, and returns `run(args)`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))

    def main(argv: list[str] | None = None) -> int:
        args = parser.parse_args(argv)
        if args.smoke:
            for key, value in smoke.items():
                if getattr(args, key) == defaults[key]:
                    setattr(args, key, value)
        return run(args)

    return parser, main
