"""Jitted device steps: pure `(params, state, batch) -> (state, out)`, the state donated.

One step function per family serves prefill (N packed prompt tokens over R rows) and decode
(N = R): it runs loops loop_begin .. loop_begin + num_loops - 1 inside ONE `lax.fori_loop`
(Ouro: every layer per loop plus the exit-gate carry, lm_head once on the selected state;
Huginn: prelude, the recurrent loops, coda), then samples on device. The loop count is a
static trip count (`StepKind.num_loops`): a traced bound would make XLA read the loop
predicate back to the host every loop. `per_loop` kinds cut a decode into one-loop
submissions (a per-loop series): the loop state between submissions stays on device in
`DeviceState.carry` (indexed by each request's carry slot), never on the host.

Rows past their own loop count (`row_loops`) freeze their state and write no KV (fixed-depth
requests never read those planes; `kv_cache.fill_last_exited` is for adaptive exits).
Padding rows write only to the drop slot. Compilation is bounded: `warmup()` runs every
bucket once; each trace bumps `compilations`; with `strict=True` a later trace raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import kv_cache
from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, RowInput, build_step_batch
from loopjax.layers import rope_angles
from loopjax.sampling import sample


class CompileAfterWarmup(RuntimeError):
    """A step compiled after warm-up (a bucket or static flag that warmup missed)."""


@dataclass(frozen=True)
class StepKind:
    """Static part of a step (hashable: part of the jit cache key)."""

    num_loops: int            # loops run: a static trip count, so no host sync per loop
    first: bool = True        # the submission starts at loop 0 (embed / prelude)
    final: bool = True        # some row ends its token here: run the tail (lm_head / coda) and sample
    save_carry: bool = False  # store the loop state of every row (per-loop decode series)


def fused(num_loops: int) -> StepKind:  # all loops of the step in one submission
    return StepKind(num_loops)


def per_loop(first: bool, final: bool) -> StepKind:
    """One loop of a per-loop decode series; the loop state stays on device between them."""
    return StepKind(1, first, final, save_carry=True)


@jax.tree_util.register_dataclass
@dataclass
class DeviceState:
    kv: kv_cache.KVPool    # the paged pool
    carry: dict            # per-loop decode state, each [max_rows + 1, ...], indexed by carry slot


@jax.tree_util.register_dataclass
@dataclass
class StepOut:
    tokens: jax.Array       # [R] i32 sampled token per row (garbage for non-emitting rows)
    exit_loops: jax.Array   # [R] i32 loops of the selected state (1-based)
    logprobs: jax.Array     # [R] f32 log-prob of the sampled token
    top_ids: jax.Array      # [R, k] i32
    top_logprobs: jax.Array  # [R, k] f32


def _put(buffer, slots, values):
    """buffer[slots] = values (padding rows all write the spare last slot)."""
    return buffer.at[slots].set(values)


def _write_mask(batch, depth):
    """[N] bool: tokens whose row still runs loop `depth`."""
    return depth < batch.row_loops[batch.row_of_token]


def _finish(logits, batch, num_top_logprobs, exit_loops):
    tokens, logprobs, top_ids, top_lp = sample(logits.astype(jnp.float32), batch.sampling,
                                               num_top_logprobs=num_top_logprobs)
    return StepOut(tokens, exit_loops, logprobs, top_ids, top_lp)


def ouro_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
              num_top_logprobs: int):
    from loopjax.models import ouro
    r = batch.page_table.shape[0]
    attn = kv_cache.PagedAttention(layout, batch, backend)
    cos, sin = rope_angles(batch.positions, cfg.head_dim, cfg.rope_theta)
    if kind.first:
        x = ouro.embed(params, batch.token_ids)
        ex = ouro.exit_init(r, cfg.hidden_size, cfg.total_ut_steps, x.dtype)
    else:
        x = state.carry["x"][batch.carry_slot]  # decode: N = R, token n is row n
        ex = jax.tree.map(lambda a: a[batch.carry_slot], state.carry["exit"])

    def body(depth, carry):
        x, kv, ex = carry
        live = _write_mask(batch, depth)
        h, kv = ouro.loop(params, cfg, x, cos, sin, attn.with_write_mask(live), kv, depth)
        x = jnp.where(live[:, None], h, x)
        last = x[batch.last_token_index]
        new = ouro.exit_update(ex, ouro.gate_logits(params, last), last, depth, batch.row_loops,
                               batch.exit_threshold)
        row_live = depth < batch.row_loops  # rows past their loops keep their selection
        return x, kv, jax.tree.map(lambda a, b: jnp.where(row_live.reshape(-1, *[1] * (a.ndim - 1)),
                                                          a, b), new, ex)

    x, kv, ex = jax.lax.fori_loop(0, kind.num_loops, lambda i, c: body(batch.loop_begin + i, c),
                                  (x, state.kv, ex))
    carry = state.carry
    if kind.save_carry:
        carry = {"x": _put(carry["x"], batch.carry_slot, x),
                 "exit": jax.tree.map(lambda c, a: _put(c, batch.carry_slot, a), carry["exit"], ex)}
    if not kind.final:
        return DeviceState(kv, carry), None
    logits = ouro.lm_head(params, ex.hidden)
    return DeviceState(kv, carry), _finish(logits, batch, num_top_logprobs, ex.exit_loop + 1)


def huginn_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
                num_top_logprobs: int):
    from loopjax.models import huginn
    attn = kv_cache.PagedAttention(layout, batch, backend)
    cos, sin = rope_angles(batch.positions, cfg.head_dim, cfg.rope_base)
    dtype = params["embed"].dtype
    if kind.first:
        e, kv = huginn.prelude(params, cfg, huginn.embed(params, cfg, batch.token_ids), cos, sin,
                               attn, state.kv)
        seeded = huginn.initial_state(cfg, batch.init_seed, batch.positions, dtype)
        s = jnp.where((batch.init_mode == INIT_EXPLICIT)[:, None], batch.init_state.astype(dtype),
                      jnp.where((batch.init_mode == INIT_SEEDED)[:, None], seeded, 0).astype(dtype))
    else:
        e, s, kv = state.carry["e"][batch.carry_slot], state.carry["s"][batch.carry_slot], state.kv

    def body(depth, carry):
        s, kv = carry
        live = _write_mask(batch, depth)
        s_new, kv = huginn.core_loop(params, cfg, s, e, cos, sin, attn.with_write_mask(live), kv,
                                     depth)
        return jnp.where(live[:, None], s_new, s), kv

    s, kv = jax.lax.fori_loop(0, kind.num_loops, lambda i, c: body(batch.loop_begin + i, c), (s, kv))
    carry = state.carry
    if kind.save_carry:
        carry = {"e": _put(carry["e"], batch.carry_slot, e), "s": _put(carry["s"], batch.carry_slot, s)}
    if not kind.final:
        return DeviceState(kv, carry), None
    # NOTE: the coda runs over every token (its KV is needed), lm_head included; only the
    # rows' last tokens are sampled.
    logits, kv = huginn.coda(params, cfg, s, cos, sin, attn, kv)
    loops = jnp.minimum(batch.row_loops, batch.loop_end)
    return DeviceState(kv, carry), _finish(logits[batch.last_token_index], batch,
                                           num_top_logprobs, loops)


def _carry_init(cfg, max_rows: int, dtype) -> dict:
    """Per-loop decode state of `max_rows` carry slots (+1: the padding rows' slot)."""
    max_rows, h = max_rows + 1, cfg.hidden_size
    if cfg.family == "huginn":
        return {"e": jnp.zeros((max_rows, h), dtype), "s": jnp.zeros((max_rows, h), dtype)}
    from loopjax.models import ouro
    # NOTE: copies, so no two donated leaves share a buffer (exit_init reuses its zeros).
    return {"x": jnp.zeros((max_rows, h), dtype), "exit": jax.tree.map(
        lambda a: jnp.array(a, copy=True), ouro.exit_init(max_rows, h, cfg.total_ut_steps, dtype))}


@dataclass
class StepResult:  # host copy of a step's outputs for the real rows (one read per submission)
    tokens: np.ndarray       # [R] int32
    exit_loops: np.ndarray   # [R] int32
    logprobs: np.ndarray     # [R] f32
    top_ids: np.ndarray      # [R, k]
    top_logprobs: np.ndarray  # [R, k]


class Runner:
    """Owns the device state (KV pool + carry) and the compiled step functions."""

    def __init__(self, model, layout: kv_cache.KVLayout, *, decode_rows: tuple[int, ...],
                 prefill_buckets: tuple[tuple[int, int], ...], max_pages: int, max_loops: int,
                 backend: str = "xla", num_top_logprobs: int = 0, strict: bool = False,
                 decode_page_widths: tuple[int, ...] = ()):
        self.cfg, self.params, self.layout = model.cfg, model.params, layout
        self.decode_rows, self.prefill_buckets = tuple(sorted(decode_rows)), tuple(sorted(prefill_buckets))
        self.max_pages, self.max_loops = max_pages, max_loops
        # Decode page-table widths (context buckets): attention work scales with the width.
        self.decode_widths = tuple(sorted({w for w in decode_page_widths if w < max_pages} | {max_pages}))
        self.num_top_logprobs, self.strict = num_top_logprobs, strict
        self.compilations, self.submissions, self.warm = 0, 0, False
        self.loop_counts = (max_loops,)  # fused loop counts compiled (warmup may add more)
        dtype = jax.tree.leaves(self.params)[0].dtype
        self.max_rows = max(self.decode_rows)  # carry slots 0..max_rows-1; max_rows = padding
        self.state = DeviceState(kv_cache.allocate(layout), _carry_init(self.cfg, self.max_rows, dtype))
        step = huginn_step if self.cfg.family == "huginn" else ouro_step
        self._hidden = self.cfg.hidden_size if self.cfg.family == "huginn" else None

        def traced(params, state, batch, kind):
            self.compilations += 1  # runs only when jax traces (a compile-cache miss)
            if self.strict and self.warm:
                raise CompileAfterWarmup(f"step compiled after warm-up: rows "
                                         f"{batch.page_table.shape[0]}, tokens "
                                         f"{batch.token_ids.shape[0]}, {kind}")
            return step(params, state, batch, cfg=self.cfg, layout=layout, backend=backend,
                        kind=kind, num_top_logprobs=num_top_logprobs)

        self._step = jax.jit(traced, static_argnums=3, donate_argnums=1)

    # ------------------------------------------------------------------ buckets
    def decode_bucket(self, num_rows: int) -> int:
        fits = [r for r in self.decode_rows if r >= num_rows]
        if not fits:
            raise ValueError(f"{num_rows} decode rows exceed the largest bucket {self.decode_rows[-1]}")
        return fits[0]

    def prefill_bucket(self, num_rows: int, num_tokens: int) -> tuple[int, int]:
        fits = [(r, n) for r, n in self.prefill_buckets if r >= num_rows and n >= num_tokens]
        if not fits:
            raise ValueError(f"prefill of {num_rows} rows / {num_tokens} tokens exceeds every bucket")
        return fits[0]

    # ------------------------------------------------------------------ running
    def make_batch(self, rows: list[RowInput], *, decode: bool, loop_begin: int, loop_end: int,
                   num_rows: int = 0, num_tokens: int = 0, page_width: int = 1):
        """Device StepBatch of `rows` in the smallest compiled bucket holding them (and at
        least (num_rows, num_tokens), and for decode a page-table width >= page_width)."""
        if not 1 <= loop_end <= self.max_loops or not 0 <= loop_begin < loop_end:
            raise ValueError(f"loops [{loop_begin}, {loop_end}) outside 0..{self.max_loops}")
        num_rows, num_tokens = max(num_rows, len(rows)), max(num_tokens, sum(len(r.token_ids) for r in rows))
        width, size = self.max_pages, self.layout.page_size
        if decode:  # the narrowest compiled page-table width that holds every row's context
            num_rows = num_tokens = self.decode_bucket(max(num_rows, num_tokens))
            needed = max([-(-(r.start_pos + 1) // size) for r in rows] + [page_width])
            width = next(w for w in self.decode_widths if w >= needed)
        else:
            num_rows, num_tokens = self.prefill_bucket(num_rows, num_tokens)
        batch = build_step_batch(rows, num_rows=num_rows, num_tokens=num_tokens, max_pages=width,
                                 page_size=size, drop_slot=self.layout.drop_slot, loop_begin=loop_begin,
                                 loop_end=loop_end, pad_carry_slot=self.max_rows,
                                 hidden_size=self._hidden)
        return jax.device_put(batch)

    def submit(self, batch, kind: StepKind):
        """One asynchronous submission; returns the device StepOut (None unless kind.final)."""
        self.submissions += 1
        self.state, out = self._step(self.params, self.state, batch, kind)
        return out

    def run(self, rows: list[RowInput], *, decode: bool, loop_begin: int = 0,
            num_loops: int | None = None, series: bool = False, num_rows: int = 0,
            num_tokens: int = 0) -> StepResult | None:
        """One step over `rows` (prefill: packed chunks; decode: one token per row) running
        loops [loop_begin, loop_begin + num_loops), then one host read of the outputs.
        series: a one-loop submission of a per-loop decode series (state kept on device)."""
        num_loops = max(r.loops for r in rows) - loop_begin if num_loops is None else num_loops
        # A fused step runs the smallest compiled loop count that covers it (rows stop at theirs).
        count = next(c for c in self.loop_counts if c >= num_loops) if not series else 1
        kind = per_loop(loop_begin == 0, any(r.emits for r in rows)) if series else fused(count)
        batch = self.make_batch(rows, decode=decode, loop_begin=loop_begin,
                                loop_end=loop_begin + num_loops, num_rows=num_rows,
                                num_tokens=num_tokens)
        out = self.submit(batch, kind)
        if out is None:
            return None
        host = jax.device_get(out)  # the one host read of this step
        k = len(rows)
        return StepResult(host.tokens[:k], host.exit_loops[:k], host.logprobs[:k],
                          host.top_ids[:k], host.top_logprobs[:k])

    def warmup(self, *, loop_counts: tuple[int, ...] = (), series: bool = False) -> int:
        """Compile (by running all-padding batches) every decode and prefill bucket for each
        fused loop count (default: max_loops); with series, the one-loop decode variants
        instead of the fused decode ones. Returns the compile count."""
        outs = []
        self.loop_counts = loop_counts = tuple(sorted(set(loop_counts) | {self.max_loops}))
        if series:
            kinds = [per_loop(f, t) for f in (True, False) for t in (True, False)]
        else:
            kinds = [fused(n) for n in loop_counts]
        for r in self.decode_rows:
            for width in self.decode_widths:
                for kind in kinds:
                    begin = 0 if kind.first else self.max_loops - 1
                    b = self.make_batch([], decode=True, loop_begin=begin,
                                        loop_end=begin + kind.num_loops, num_rows=r, page_width=width)
                    outs.append(self.submit(b, kind))
        for r, n in self.prefill_buckets:
            for count in loop_counts:
                b = self.make_batch([], decode=False, loop_begin=0, loop_end=count, num_rows=r,
                                    num_tokens=n)
                outs.append(self.submit(b, fused(count)))
        jax.block_until_ready((outs, self.state))
        self.warm = True
        return self.compilations

