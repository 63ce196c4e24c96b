"""Jitted device steps: pure `(params, state, batch) -> (state, out)`, the state donated.

One step function per family serves prefill (N packed prompt tokens over R rows) and decode
(N = R): it runs loops loop_begin .. loop_begin + num_loops - 1 inside ONE `lax.fori_loop`
(Ouro: every layer per loop plus the exit-gate carry, lm_head once on the selected state;
Huginn: prelude, the recurrent loops, coda), then samples on device. The loop count is a
static trip count (`StepKind.num_loops`): a traced bound would make XLA read the loop
predicate back to the host every loop. `per_loop` kinds cut a decode into one-loop
submissions (a per-loop series): the loop state between submissions stays on device in
`DeviceState.carry` (indexed by each request's carry slot), never on the host.

The host reads a step back with `read(dispatch(...))`; between the two it may plan and
dispatch the next step: a token the host has not read yet reaches the next step through
`DeviceState.last_tokens` (each emitting row writes its slot, `StepBatch.token_from_device`
tokens read it), and the device runs the submissions in dispatch order.

Rows past their own loop count (`row_loops`) freeze their state and write no KV (fixed-depth
requests never read those planes; `kv_cache.fill_last_exited` is for adaptive exits).
Padding rows write only to the drop slot. Compilation is bounded: `warmup()` compiles every
bucket ahead of time; each trace bumps `compilations`; with `strict=True` a later one raises.
Every executable built is timed in `compile_times` (loopjax.compilation.CompileTime).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from loopjax import kv_cache
from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, INIT_WARM, Buckets, RowInput, StepResult
from loopjax.compilation import CompileTime, compile_lowered, use_compilation_cache
from loopjax.kv_cache import DeviceState
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, XLA_OPS, Ops, rms_norm, rope_angles
from loopjax.sampling import sample


class CompileAfterWarmup(RuntimeError):  # a step compiled after warm-up (strict runners)
    pass


@dataclass(frozen=True)
class StepKind:
    """Static part of a step (hashable: part of the jit cache key)."""
    num_loops: int            # loops run: a static trip count, so no host sync per loop
    first: bool = True        # the submission starts at loop 0 (embed / prelude)
    final: bool = True        # some row ends its token here: run the tail (lm_head / coda) and sample
    save_carry: bool = False  # store the loop state of every row (per-loop decode series)
    adaptive: bool = False    # while_loop that ends when every real row exited (skip rows stop)
    unroll: int = 1           # fixed-depth loops unrolled per fori_loop iteration (True: all)
    weighted: bool = False    # Ouro: also accumulate sum_i p_i * lm_head(h_i) (weighted-exit rows)


def fused(num_loops: int, adaptive: bool = False, unroll: int = 1,
          weighted: bool = False) -> StepKind:  # one submission
    return StepKind(num_loops, adaptive=adaptive, unroll=unroll, weighted=weighted)


def per_loop(first: bool, final: bool) -> StepKind:
    """One loop of a per-loop decode series; the loop state stays on device between them."""
    return StepKind(1, first, final, save_carry=True)


@jax.tree_util.register_dataclass
@dataclass
class StepOut:  # device outputs of a step
    tokens: jax.Array       # [R] i32 sampled token per row (garbage for non-emitting rows)
    exit_loops: jax.Array   # [R] i32 loops of the selected state (1-based)
    logprobs: jax.Array     # [R] f32 log-prob of the sampled token
    top_ids: jax.Array      # [R, k] i32
    top_logprobs: jax.Array  # [R, k] f32


@dataclass
class PendingStep:
    """A dispatched step not yet read back: its device outputs (None for a non-final per-loop
    submission), the number of real rows to read and whether a row asked for logprobs."""
    out: StepOut | None
    num_rows: int
    logprobs: bool = True


def _put(buffer, slots, values):  # buffer[slots] = values (padding rows: the spare last slot)
    return buffer.at[slots].set(values)


def _input_ids(state: DeviceState, batch):
    """[N] the step's token ids: a token sampled by a step still in flight comes from its row's
    last-token slot (the host has not read it), the others from the batch."""
    from_slot = state.last_tokens[batch.token_slot[batch.row_of_token]]
    return jnp.where(batch.token_from_device, from_slot, batch.token_ids)


def _finish(state: DeviceState, kv, carry, logits, batch, num_top_logprobs, exit_loops):
    """Sample; each emitting row's token also goes to its last-token slot (others: the spare)."""
    tokens, logprobs, top_ids, top_lp = sample(logits.astype(jnp.float32), batch.sampling,
                                               num_top_logprobs=num_top_logprobs)
    spare = state.last_tokens.shape[0] - 1
    last_tokens = _put(state.last_tokens, jnp.where(batch.row_is_real, batch.token_slot, spare), tokens)
    return DeviceState(kv, carry, last_tokens), StepOut(tokens, exit_loops, logprobs, top_ids, top_lp)


def _depth_loop(kind: StepKind, batch, body, carry, done):
    """Loops loop_begin.. of `body(depth, carry)`: a static trip count, or (adaptive) a
    while_loop that also ends once every real row is `done(carry)` [R] or past its own loop
    count (an exit trace or a smaller fixed depth: such rows are frozen, so stopping early
    changes nothing but the work)."""
    if not kind.adaptive:
        return jax.lax.fori_loop(0, kind.num_loops, lambda i, c: body(batch.loop_begin + i, c), carry,
                                 unroll=kind.unroll)

    def go(c):
        finished = done(c[1]) | (batch.loop_begin + c[0] >= batch.row_loops) | ~batch.row_is_real
        return (c[0] < kind.num_loops) & ~jnp.all(finished)
    return jax.lax.while_loop(go, lambda c: (c[0] + 1, body(batch.loop_begin + c[0], c[1])),
                              (jnp.int32(0), carry))[1]


def ouro_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
              num_top_logprobs: int, ops):
    from loopjax.models import ouro
    r = batch.page_table.shape[0]
    attn = kv_cache.PagedAttention(layout, batch, backend)
    cos, sin = rope_angles(batch.positions, cfg.head_dim, cfg.rope_theta)
    if kind.first:
        x = ouro.embed(params, _input_ids(state, batch))
        ex = ouro.exit_init(r, cfg.hidden_size, cfg.total_ut_steps, x.dtype)
    else:
        x = state.carry["x"][batch.carry_slot]  # decode: N = R, token n is row n
        ex = jax.tree.map(lambda a: a[batch.carry_slot], state.carry["exit"])
    stopped = lambda ex: ex.exited & batch.exit_skip  # noqa: E731  (skip rows stop at the exit)
    # A fixed exit loop k (exit_step) selects loop k as if it were the row's last loop.
    select_loops = jnp.where(batch.exit_step >= 0, jnp.minimum(batch.exit_step + 1, batch.row_loops),
                             batch.row_loops)
    # Weighted kinds: Σ_i p_i·lm_head(h_i) of the rows' last tokens, in the model dtype and in
    # loop order exactly as ouro.weighted_logits (rows run every loop; others ignore it).
    acc = jnp.zeros((r, cfg.vocab_size), x.dtype) if kind.weighted else None

    def body(depth, carry):
        x, kv, ex, acc = carry
        row_live = (depth < batch.row_loops) & ~stopped(ex)
        live = row_live[batch.row_of_token]
        h, kv = ouro.loop(params, cfg, x, cos, sin, attn.with_write_mask(live), kv, depth, ops)
        x = jnp.where(live[:, None], h, x)
        last = x[batch.last_token_index]
        gate = ouro.gate_logits(params, last)
        if kind.weighted:
            p, _ = ouro._exit_mass(ouro._sigmoid(gate), ex.remaining, depth == batch.row_loops - 1)
            logits = ops.linear(last, params["lm_head"])
            term = logits * p.astype(logits.dtype)[:, None]
            acc = jnp.where(row_live[:, None], jnp.where(depth == 0, term, acc + term), acc)
        new = ouro.exit_update(ex, gate, last, depth, select_loops, batch.exit_threshold)
        return x, kv, jax.tree.map(lambda a, b: jnp.where(row_live.reshape(-1, *[1] * (a.ndim - 1)),
                                                          a, b), new, ex), acc

    x, kv, ex, acc = _depth_loop(kind, batch, body, (x, state.kv, ex, acc), lambda c: stopped(c[2]))
    carry = state.carry
    if kind.save_carry:
        carry = {"x": _put(carry["x"], batch.carry_slot, x),
                 "exit": jax.tree.map(lambda c, a: _put(c, batch.carry_slot, a), carry["exit"], ex)}
    if not kind.final:
        return DeviceState(kv, carry, state.last_tokens), None
    if kind.adaptive:
        kv = kv_cache.fill_rows(kv, layout, range(cfg.num_layers), batch, ex.exit_loop)
    logits = ops.linear(ex.hidden, params["lm_head"])  # ouro.lm_head through the ops seam
    if kind.weighted:
        logits = jnp.where(batch.exit_weighted[:, None], acc, logits)
    return _finish(state, kv, carry, logits, batch, num_top_logprobs, ex.exit_loop + 1)


def huginn_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
                num_top_logprobs: int, ops):
    from loopjax import exits
    from loopjax.models import huginn
    attn = kv_cache.PagedAttention(layout, batch, backend)
    cos, sin = rope_angles(batch.positions, cfg.head_dim, cfg.rope_base)
    dtype, last = params["embed"].dtype, batch.last_token_index
    if kind.first:
        e, kv = huginn.prelude(params, cfg, huginn.embed(params, cfg, _input_ids(state, batch)), cos,
                               sin, attn, state.kv, ops)
        seeded = huginn.initial_state(cfg, batch.init_seed, batch.positions, dtype)
        s = jnp.where((batch.init_mode == INIT_EXPLICIT)[:, None], batch.init_state.astype(dtype),
                      jnp.where((batch.init_mode == INIT_SEEDED)[:, None], seeded, 0).astype(dtype))
        warm = state.carry["warm"][batch.carry_slot[batch.row_of_token]]
        s = jnp.where((batch.init_mode == INIT_WARM)[:, None], warm, s)
    else:
        e, s, kv = state.carry["e"][batch.carry_slot], state.carry["s"][batch.carry_slot], state.kv
    # Adaptive: criteria state; `sel` the selected (exit loop's) state; `ran` its loop count.
    xs = exits.init(batch.exit, s, cfg.vocab_size) if kind.adaptive else None
    ran = jnp.zeros(batch.row_loops.shape, jnp.int32)

    def body(depth, carry):
        s, kv, xs, sel, ran = carry
        exited = xs.exited if kind.adaptive else jnp.zeros_like(batch.exit_skip)
        row_live = (depth < batch.row_loops) & ~(exited & batch.exit_skip)
        live = row_live[batch.row_of_token]
        s_new, kv = huginn.core_loop(params, cfg, s, e, cos, sin, attn.with_write_mask(live), kv,
                                     depth, ops)
        s = jnp.where(live[:, None], s_new, s)
        if kind.adaptive:  # the logit criteria need the coda (with its KV writes) on checked loops
            logits, kv = jax.lax.cond(
                exits.needs_logits(batch.exit, xs, depth, active=row_live),
                lambda kv: huginn.coda(params, cfg, s, cos, sin, attn, kv, ops),
                lambda kv: (jnp.zeros((s.shape[0], cfg.vocab_size), dtype), kv), kv)
            xs, _ = exits.update(xs, batch.exit, logits[last], s, depth,
                                 row_of_token=batch.row_of_token, active=row_live)
        selecting = row_live & ~exited  # rows follow s up to their exit loop, then keep it
        sel = jnp.where(selecting[batch.row_of_token][:, None], s, sel)
        return s, kv, xs, sel, jnp.where(selecting, depth + 1, ran)

    s, kv, xs, sel, ran = _depth_loop(kind, batch, body, (s, kv, xs, s, ran),
                                      lambda c: c[2].exited & batch.exit_skip)
    carry = state.carry
    if kind.save_carry:
        carry = {**carry, "e": _put(carry["e"], batch.carry_slot, e),
                 "s": _put(carry["s"], batch.carry_slot, s)}
    if not kind.final:
        return DeviceState(kv, carry, state.last_tokens), None
    if kind.adaptive:
        core = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
        kv = kv_cache.fill_rows(kv, layout, core, batch, ran - 1)
    # NOTE: the coda of the selected state runs over every token (its KV is the one later
    # tokens read), lm_head included; only the rows' last tokens are sampled.
    logits, kv = huginn.coda(params, cfg, sel, cos, sin, attn, kv, ops)
    # Warm start: the next token of a row starts from ln_f of this token's selected state.
    warm = rms_norm(sel[last], params["ln_f"], cfg.norm_eps)
    carry = {**carry, "warm": _put(carry["warm"], batch.carry_slot, warm)}
    loops = ran if kind.first else jnp.minimum(batch.row_loops, batch.loop_end)
    return _finish(state, kv, carry, logits[last], batch, num_top_logprobs, loops)


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
        dtype = jax.tree.leaves(self.params)[0].dtype
        self.state = kv_cache.allocate_state(self.cfg, layout, self.max_rows, dtype)
        step = huginn_step if self.cfg.family == "huginn" else ouro_step

        def traced(params, state, batch, kind):
            self.compilations += 1  # runs only when jax traces (a compile-cache miss)
            if self.strict and self.warm:
                raise CompileAfterWarmup(f"step compiled after warm-up: rows "
                                         f"{batch.page_table.shape[0]}, tokens "
                                         f"{batch.token_ids.shape[0]}, {kind}")
            return step(params, state, batch, cfg=self.cfg, layout=layout, backend=backend,
                        kind=kind, num_top_logprobs=num_top_logprobs, ops=ops)

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
        # A fused step runs the smallest compiled loop count that covers it (rows stop at theirs).
        count = next(c for c in self.loop_counts if c >= num_loops) if not series else 1
        adaptive = not series and any(r.exit_skip or r.exit_spec is not None for r in rows)
        weighted = not series and any(r.exit_weighted for r in rows)
        kind = (per_loop(loop_begin == 0, any(r.emits for r in rows)) if series
                else fused(count, adaptive, self.unroll, weighted))
        batch = self.make_batch(rows, decode=decode, loop_begin=loop_begin,
                                loop_end=loop_begin + num_loops, num_rows=num_rows,
                                num_tokens=num_tokens, adaptive=adaptive)
        return PendingStep(self.submit(batch, kind), len(rows),
                           any(r.params.logprobs is not None for r in rows))

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
                          host.top_ids[:k], host.top_logprobs[:k])

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
        self.warm = True
        return self.compilations

    def warmup_steps(self, *, loop_counts=(), series=False, adaptive=False, weighted=False) -> list:
        """(batch, kind) of every executable warm-up builds, one per executable, nothing
        compiled: every decode and prefill bucket for each fused loop count (and max_loops);
        series: the one-loop decode kinds instead of the fused ones; adaptive, weighted (Ouro's
        weighted exit): those kinds too. Sets the fused loop counts `dispatch` picks from."""
        todo = []  # (batch, kind)
        self.loop_counts = loop_counts = tuple(sorted(set(loop_counts) | {self.max_loops}))
        fused_kinds = [fused(n, a, self.unroll, w) for n in loop_counts for a in {False, adaptive}
                       for w in {False, weighted}]
        kinds = [per_loop(f, t) for f in (True, False) for t in (True, False)] if series else fused_kinds
        for r in self.buckets.decode_rows:
            for width in self.buckets.page_widths:
                for kind in kinds:
                    begin = 0 if kind.first else self.max_loops - 1
                    b = self.make_batch([], decode=True, loop_begin=begin, loop_end=begin + kind.num_loops,
                                        num_rows=r, page_width=width, adaptive=kind.adaptive)
                    todo.append((b, kind))
        for r, n in self.buckets.prefill:
            for kind in fused_kinds:
                b = self.make_batch([], decode=False, loop_begin=0, loop_end=kind.num_loops, num_rows=r,
                                    num_tokens=n, adaptive=kind.adaptive)
                todo.append((b, kind))
        return todo

    def precompile(self, steps, threads: int | None = None) -> None:
        """Ahead-of-time executables for (batch, kind) pairs: traced and lowered in turn, each
        XLA compile started in a worker thread (`threads`, default the CPU count) as soon as its
        step is lowered, so lowering overlaps compiling; each timed (`compile_times`)."""
        todo = {}  # key -> (batch, kind), new shapes only
        for batch, kind in steps:
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
