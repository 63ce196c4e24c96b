"""The host side of the device steps (loopjax/steps.py): `Runner` owns the device state (KV
pool + carry), jits the family's step with the state donated, and builds, compiles and
submits its executables.

The host reads a step back with `read(dispatch(...))`; between the two it may plan and
dispatch the next step (the device runs the submissions in dispatch order; a token not read
yet reaches the next step on device, steps.py). Compilation is bounded: `warmup()` compiles
every bucket ahead of time; each trace bumps `compilations`; with `strict=True` a later one
raises. Every executable built is timed in `compile_times` (loopjax.compilation.CompileTime).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from dataclasses import dataclass

import jax

from loopjax import kv_cache
from loopjax.batch import Buckets, RowInput, StepResult
from loopjax.compilation import CompileTime, compile_lowered, use_compilation_cache
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, XLA_OPS, Ops
from loopjax.steps import StepKind, StepOut, fused_kind, huginn_step, ouro_step, per_loop


class CompileAfterWarmup(RuntimeError):  # a step compiled after warm-up (strict runners)
    pass


@dataclass
class PendingStep:
    """A dispatched step not yet read back: its device outputs (None for a non-final per-loop
    submission), the number of real rows to read and whether a row asked for logprobs."""
    out: StepOut | None
    num_rows: int
    logprobs: bool = True


class Runner:
    """Owns the device state (KV pool + carry) and the compiled step functions."""

    def __init__(self, model, layout: kv_cache.KVLayout, *, decode_rows: tuple[int, ...],
                 prefill_buckets: tuple[tuple[int, int], ...], max_pages: int, max_loops: int,
                 backend: str = "xla", num_top_logprobs: int = 0, strict: bool = False,
                 decode_page_widths: tuple[int, ...] = (), ops: Ops = XLA_OPS, unroll: int = 1,
                 compilation_cache_dir: str | None = None):
        if compilation_cache_dir is not None:  # before anything compiles (process-wide JAX state)
            use_compilation_cache(compilation_cache_dir)
        self.cfg, self.params, self.layout = model.cfg, model.params, layout
        self.max_loops, self.num_top_logprobs, self.strict = max_loops, num_top_logprobs, strict
        self.unroll = unroll
        self.max_rows = max(decode_rows)  # carry slots 0..max_rows-1; max_rows = padding rows'
        self.buckets = Buckets(tuple(sorted(decode_rows)), tuple(sorted(prefill_buckets)),
                               tuple(sorted({w for w in decode_page_widths if w < max_pages}
                                            | {max_pages})), layout.page_size, layout.drop_slot,
                               self.max_rows, model.cfg.hidden_size if model.cfg.family == "huginn"
                               else None)
        self.compilations, self.submissions, self.warm = 0, 0, False
        self._compiled: dict = {}  # (kind, batch shapes) -> ahead-of-time executable
        self.compile_times: list[CompileTime] = []  # one per executable built, in build order
        self.loop_counts = (max_loops,)  # fused loop counts compiled (warmup may add more)
        self.dtype = jax.tree.leaves(self.params)[0].dtype
        self.state = kv_cache.allocate_state(self.cfg, layout, self.max_rows, self.dtype)
        step = huginn_step if self.cfg.family == "huginn" else ouro_step

        def traced(params, state, batch, kind):
            self.compilations += 1  # runs only when jax traces (a compile-cache miss)
            if self.strict and self.warm:
                raise CompileAfterWarmup(f"step compiled after warm-up: rows "
                                         f"{batch.page_table.shape[0]}, tokens "
                                         f"{batch.token_ids.shape[0]}, {kind}")
            # NOTE: the greedy sampler computes no top logprobs (rows asking for them take the
            # full one, SamplingParams.is_plain_greedy): its steps pay nothing for max_logprobs
            return step(params, state, batch, cfg=self.cfg, layout=layout, backend=backend, kind=kind,
                        num_top_logprobs=0 if kind.greedy else num_top_logprobs, ops=ops)

        self._step = jax.jit(traced, static_argnums=3, donate_argnums=1,
                             compiler_options=IDENTITY_COMPILER_OPTIONS)

    def make_batch(self, rows: list[RowInput], *, decode: bool, loop_begin: int, loop_end: int,
                   adaptive: bool = False, **bucket):
        """Host (numpy) StepBatch of `rows` in the smallest compiled bucket (batch.Buckets.build).
        The step's call moves it to the device inside jax's C++ dispatch: a `jax.device_put` of
        its ~25 leaves first cost ~0.5 ms of host time per step (CPU: 616 vs 72 us per call,
        bench/RESULTS.md run 13), which a single stream, near host-bound, pays every token."""
        if not 1 <= loop_end <= self.max_loops or not 0 <= loop_begin < loop_end:
            raise ValueError(f"loops [{loop_begin}, {loop_end}) outside 0..{self.max_loops}")
        return self.buckets.build(rows, decode=decode, loop_begin=loop_begin, loop_end=loop_end,
                                  adaptive=adaptive, **bucket)

    def _key(self, batch, kind: StepKind):
        leaves, structure = jax.tree.flatten(batch)
        return kind, tuple((a.shape, a.dtype) for a in leaves), structure

    def _lower(self, batch, kind: StepKind):
        """(jax Lowered, its CompileTime so far); traces: counted; strict runners raise when warm."""
        start = time.perf_counter()
        lowered = self._step.lower(self.params, self.state, batch, kind)
        return lowered, CompileTime.of(batch, kind, lower_s=time.perf_counter() - start)

    def submit(self, batch, kind: StepKind):
        """One asynchronous run of the shapes' executable (compiled now if missing); returns
        the device StepOut (None unless kind.final)."""
        if self.state is None:  # reset_state could not allocate it
            raise RuntimeError("the device state was lost with a failed step and could not be made "
                               "anew; build a new engine")
        key = self._key(batch, kind)
        if key not in self._compiled:
            self.precompile([(batch, kind)], threads=1)
        self.submissions += 1
        self.state, out = self._compiled[key](self.params, self.state, batch)
        return out

    def run(self, rows: list[RowInput], **step) -> StepResult | None:
        """dispatch() then read(): one step and its one host read."""
        return self.read(self.dispatch(rows, **step))

    def dispatch(self, rows: list[RowInput], *, decode: bool, loop_begin: int = 0,
                 num_loops: int | None = None, series: bool = False, num_rows: int = 0,
                 num_tokens: int = 0) -> PendingStep:
        """Submit one step over `rows` (prefill: packed chunks; decode: one token per row)
        running loops [loop_begin, loop_begin + num_loops); returns without waiting.
        series: a one-loop submission of a per-loop decode series (state kept on device)."""
        num_loops = max(r.loops for r in rows) - loop_begin if num_loops is None else num_loops
        count = self.fused_loop_count(num_loops) if not series else 1
        adaptive = not series and any(r.exit_skip or r.exit_spec is not None for r in rows)
        weighted = not series and any(r.exit_weighted for r in rows)
        kind = (per_loop(loop_begin == 0, any(r.emits for r in rows)) if series
                else fused_kind(count, decode=decode, all_greedy=all(r.params.is_plain_greedy for r in rows),
                                adaptive=adaptive, unroll=self.unroll, weighted=weighted))
        batch = self.make_batch(rows, decode=decode, loop_begin=loop_begin,
                                loop_end=loop_begin + num_loops, num_rows=num_rows,
                                num_tokens=num_tokens, adaptive=adaptive)
        return PendingStep(self.submit(batch, kind), len(rows),
                           any(r.params.logprobs is not None for r in rows))

    def fused_loop_count(self, num_loops: int) -> int:
        """The loops a fused step of num_loops loops runs: the smallest compiled loop count that
        covers it (rows stop at theirs; the scheduler's prefill share counts it)."""
        return next(c for c in self.loop_counts if c >= num_loops)

    def read(self, pending: PendingStep) -> StepResult | None:
        """The host copy of a dispatched step's outputs (waits for the device); None for a
        non-final per-loop submission. Logprobs only if a row asked (else None): each array
        read is one device-to-host copy."""
        if pending.out is None:
            return None
        k, o = pending.num_rows, pending.out
        if not pending.logprobs:
            return StepResult(*[a[:k] for a in jax.device_get((o.tokens, o.exit_loops))], None, None, None)
        host = jax.device_get(o)  # the one host read of this step
        return StepResult(host.tokens[:k], host.exit_loops[:k], host.logprobs[:k],
                          host.top_ids[:k], host.top_logprobs[:k], host.ranks[:k])

    def reset_state(self) -> None:
        """A fresh (zeroed) device state: after a step failed on the device, the state it was
        donated (and every later step's) may be lost with it. The executables stay. If this
        raises (the device is gone), `submit` refuses every later step in one line."""
        self.state = None  # NOTE: the old buffers go before the new ones are allocated
        self.state = kv_cache.allocate_state(self.cfg, self.layout, self.max_rows, self.dtype)

    def warmup(self, *, loop_counts=(), series=False, adaptive=False, weighted=False,
               threads=None) -> int:
        """Precompile every step of `warmup_steps` (same options), then run each once on its
        padding-only batch (padding writes only the drop slot and the padding carry slot), so
        that no request pays an executable's first run (run 12, H200: the first burst after
        a compile-only warm-up ran 0.2-0.5 s slower than the next); returns the trace count."""
        steps = self.warmup_steps(loop_counts=loop_counts, series=series, adaptive=adaptive,
                                  weighted=weighted)
        self.precompile(steps, threads)
        jax.block_until_ready([self.submit(batch, kind) for batch, kind in steps])
        self.submissions -= len(steps)  # NOTE: warm-up runs are not the workload's submissions
        # A full collection now, not during the first requests: tracing and compiling leave
        # millions of objects, and Python's first full collection after them would stall the
        # host for long enough to starve the device (bench/RESULTS.md run 20: burst-128's first
        # burst 3,820 tok/s, the next 4,160; 4,185 with the collector off). After it, another
        # full collection waits until the long-lived objects grow by a quarter.
        gc.collect()
        self.warm = True
        return self.compilations

    def warmup_steps(self, *, loop_counts=(), series=False, adaptive=False, weighted=False) -> list:
        """(batch, kind) of every executable warm-up builds, one per executable, nothing
        compiled: every decode and prefill bucket for each fused loop count (and max_loops);
        series: the one-loop decode kinds instead of the fused ones; adaptive, weighted (Ouro's
        weighted exit): those kinds too, each with every sampler `fused_kind` may pick (all
        greedy rows or not). Sets the fused loop counts `dispatch` picks from."""
        todo = []  # (batch, kind)
        self.loop_counts = loop_counts = tuple(sorted(set(loop_counts) | {self.max_loops}))

        def fused_kinds(decode):  # dict: distinct kinds in a fixed order
            return list(dict.fromkeys(
                fused_kind(n, decode=decode, all_greedy=g, adaptive=a, unroll=self.unroll, weighted=w)
                for n in loop_counts for a in {False, adaptive} for w in {False, weighted}
                for g in (False, True)))
        kinds = ([per_loop(f, t) for f in (True, False) for t in (True, False)] if series
                 else fused_kinds(decode=True))
        for r in self.buckets.decode_rows:
            for width in self.buckets.page_widths:
                for kind in kinds:
                    begin = 0 if kind.first else self.max_loops - 1
                    b = self.make_batch([], decode=True, loop_begin=begin, loop_end=begin + kind.num_loops,
                                        num_rows=r, page_width=width, adaptive=kind.adaptive)
                    todo.append((b, kind))
        for r, n in self.buckets.prefill:
            for kind in fused_kinds(decode=False):
                b = self.make_batch([], decode=False, loop_begin=0, loop_end=kind.num_loops, num_rows=r,
                                    num_tokens=n, adaptive=kind.adaptive)
                todo.append((b, kind))
        return todo

    def precompile(self, steps, threads: int | None = None) -> None:
        """Ahead-of-time executables for (batch, kind) pairs: traced and lowered in turn, each
        XLA compile started in a worker thread (`threads`, default the CPU count) as soon as its
        step is lowered, so lowering overlaps compiling; each timed (`compile_times`). Lowered
        the likely longest compiles first (`compile_order`), so that they do not start last."""
        todo = {}  # key -> (batch, kind), new shapes only
        for batch, kind in sorted(steps, key=compile_order):
            key = self._key(batch, kind)
            if key not in self._compiled:
                todo.setdefault(key, (batch, kind))
        records = []  # CompileTime so far, in todo's order

        def lowered_steps():
            for batch, kind in todo.values():
                lowered, record = self._lower(batch, kind)
                records.append(record)
                yield lowered

        built = compile_lowered(lowered_steps(), threads or os.cpu_count() or 1)
        for key, record, (executable, seconds, hit) in zip(todo, records, built, strict=True):
            self._compiled[key] = executable
            self.compile_times.append(dataclasses.replace(record, compile_s=seconds, cache_hit=hit))


def compile_order(step) -> tuple:
    """Sort key of a (batch, kind) pair: prefill steps before decode steps, the most tokens
    first. The warm-up's compiles run in parallel while its steps lower one at a time, so it
    ends about when the compile started last ends. On the H200 Huginn-0125's prefill steps of
    32-2,048 tokens compile in 13-28 s and its decode steps in 4-9 s, but they lower in ~1 s
    and ~2 s (bench/RESULTS.md run 22, call 2)."""
    batch, _ = step
    return batch.decode, -batch.token_ids.shape[0]
