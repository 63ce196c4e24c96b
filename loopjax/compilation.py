"""Building the runner's executables: parallel XLA compiles, their times, the persistent cache.

The runner traces and lowers its steps one at a time in its own thread (a trace bumps its
counters and may raise its compile guard); `compile_lowered` compiles each in a worker
thread as soon as it is lowered, while the next ones lower, and times each in its thread.
`CompileTime` records one executable: its shapes and kind, the lowering and compile
seconds, and whether JAX's persistent compilation cache (`use_compilation_cache`,
EngineConfig.compilation_cache_dir) supplied it instead; the cache is seen through its
jax.monitoring hit event, recorded by the thread that loads the entry.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring: an executable was loaded


@dataclass(frozen=True)
class CompileTime:
    """One executable the runner built: what it runs, and where its start-up time went."""
    rows: int            # R
    tokens: int          # N (N = R for a decode)
    page_width: int      # M, pages per row in the page table
    decode: bool         # a decode step (StepBatch.decode), else a prefill
    kind: object         # steps.StepKind of the executable
    lower_s: float       # trace + lowering to StableHLO, in the calling thread (one at a time)
    compile_s: float = 0.0   # XLA compile in its worker thread (wall seconds: parallel compiles
    #                          share the CPUs), or the load from the persistent cache
    cache_hit: bool = False  # loaded from the persistent compilation cache, not compiled

    @classmethod
    def of(cls, batch, kind, lower_s: float) -> CompileTime:  # batch: the step's StepBatch
        (rows, width), tokens = batch.page_table.shape, batch.token_ids.shape[0]
        return cls(rows, tokens, width, batch.decode, kind, lower_s)

    @property
    def seconds(self) -> float:
        return self.lower_s + self.compile_s

    @property
    def label(self) -> str:
        """e.g. 'decode rows=32 width=256 loops=4 adaptive greedy', 'prefill rows=4 tokens=512 ...'."""
        k = self.kind
        shape = (f"decode rows={self.rows}" if self.decode
                 else f"prefill rows={self.rows} tokens={self.tokens}")
        flags = [name for name, on in (("adaptive", k.adaptive), ("weighted", k.weighted),
                                       ("greedy", k.greedy),
                                       ("one-loop", k.save_carry), ("first", k.save_carry and k.first),
                                       ("final", k.save_carry and k.final)) if on]
        return " ".join([f"{shape} width={self.page_width} loops={k.num_loops}", *flags])


def compile_totals(times: list[CompileTime]) -> dict:
    """Engine.stats() keys: seconds spent building executables (lowering plus compiling, summed
    over threads) and how many of them the persistent cache supplied."""
    return {"compile_s": sum(t.seconds for t in times),
            "compile_cache_hits": sum(t.cache_hit for t in times)}


def compile_lowered(lowered: Iterable, threads: int) -> list[tuple[object, float, bool]]:
    """(executable, compile seconds, cache hit) of each jax Lowered, compiled in up to
    `threads` worker threads, each timed in its own thread. Each compile starts as soon as
    `lowered` yields its step: a generator that lowers one step at a time overlaps the
    lowering of the next steps (the calling thread, holding the GIL) with XLA's compiles."""
    hits = threading.local()  # persistent-cache loads recorded by this thread's current compile

    def on_event(event, **_):
        if event == CACHE_HIT_EVENT:
            hits.count = getattr(hits, "count", 0) + 1

    def compile_one(step):
        hits.count, start = 0, time.perf_counter()
        executable = step.compile()
        return executable, time.perf_counter() - start, hits.count > 0

    jax.monitoring.register_event_listener(on_event)
    pool = ThreadPoolExecutor(max(1, threads))
    try:
        return list(pool.map(compile_one, lowered))  # map submits each step as it comes
    finally:
        # NOTE: an interrupt (Ctrl-C during the warm-up) waits only for the compiles already
        # running (XLA's cannot be stopped), not for every step queued behind them
        pool.shutdown(wait=True, cancel_futures=True)
        jax.monitoring.unregister_event_listener(on_event)


def use_compilation_cache(path: str) -> None:
    """Turn on JAX's persistent compilation cache in folder `path` for every executable (no
    minimum compile time or entry size). Process-wide JAX state: every later compile of this
    process, by any engine, reads and writes that folder."""
    from jax.experimental.compilation_cache import compilation_cache

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):  # makedirs said only "File exists"
        raise ValueError(f"compilation_cache_dir {path!r} is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir {path!r}: {e.strerror or e}") from None
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # NOTE: JAX opens its cache folder once; reopen it here
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size minimum
