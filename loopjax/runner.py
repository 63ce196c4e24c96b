"""Jitted device steps: pure `(params, state, batch) -> (state, out)`, the state donated.

One step function per family serves prefill (N packed prompt tokens over R rows) and decode
(N = R): it runs the loops [batch.loop_begin, batch.loop_end) inside ONE `lax.fori_loop`
(Ouro: every layer per loop plus the exit-gate carry, lm_head once on the selected state;
Huginn: prelude, the recurrent loops, coda), then samples on device. Static `StepKind` flags
`first`/`final` cut a decode into one-loop submissions (the unfused baseline): the loop
state between submissions stays on device in `DeviceState.carry`, never on the host.

Rows past their own loop count (`row_loops`) freeze their state and write no KV; afterwards
their deeper planes get the "last exited" fill. Padding rows write only to the drop slot.
Compilation is bounded: `warmup()` runs every bucket once; each trace bumps `compilations`,
and with `strict=True` a trace after warm-up raises `CompileAfterWarmup`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import kv_cache
from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, RowInput, build_step_batch
from loopjax.layers import rope_angles
from loopjax.sampling import sample
from loopjax.sampling_params import SamplingParams


class CompileAfterWarmup(RuntimeError):
    """A step function compiled after warm-up (a bucket or static flag missed by warmup)."""


@dataclass(frozen=True)
class StepKind:
    """Static part of a step (hashable: part of the jit cache key)."""

    first: bool = True     # the submission starts at loop 0 (embed / prelude)
    final: bool = True     # the submission ends at the last loop (lm_head / coda, sampling)


@jax.tree_util.register_dataclass
@dataclass
class DeviceState:
    kv: kv_cache.KVPool
    carry: dict            # unfused decode state, each [max_rows, ...] (rows of the batch)


@jax.tree_util.register_dataclass
@dataclass
class StepOut:
    tokens: jax.Array       # [R] i32 sampled token per row (garbage for non-emitting rows)
    exit_loops: jax.Array   # [R] i32 loops of the selected state (1-based)
    logprobs: jax.Array     # [R] f32 log-prob of the sampled token
    top_ids: jax.Array      # [R, k] i32
    top_logprobs: jax.Array  # [R, k] f32


def _write_mask(batch, depth):
    """[N] bool: tokens whose row still runs loop `depth`."""
    return depth < batch.row_loops[batch.row_of_token]


def _finish(logits, batch, num_top_logprobs, exit_loops):
    tokens, logprobs, top_ids, top_lp = sample(logits.astype(jnp.float32), batch.sampling,
                                               num_top_logprobs=num_top_logprobs)
    return StepOut(tokens, exit_loops, logprobs, top_ids, top_lp)


def _fill(kv, layout, layer_ids, batch, loop_end):
    """"Last exited" fill for tokens of rows that stopped before `loop_end` (skipped when none)."""
    exit_depth = batch.row_loops[batch.row_of_token] - 1
    needed = jnp.any((exit_depth < loop_end - 1) & (batch.slot_mapping < layout.drop_slot))
    max_depth = max(layout.num_planes)
    return jax.lax.cond(needed, lambda kv: kv_cache.fill_last_exited(
        kv, layout, layer_ids, batch.slot_mapping, exit_depth, max_depth), lambda kv: kv, kv)


def ouro_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
              num_top_logprobs: int):
    from loopjax.models import ouro
    n, r = batch.token_ids.shape[0], batch.page_table.shape[0]
    attn = kv_cache.PagedAttention(layout, batch, backend)
    cos, sin = rope_angles(batch.positions, cfg.head_dim, cfg.rope_theta)
    if kind.first:
        x = ouro.embed(params, batch.token_ids)
        ex = ouro.exit_init(r, cfg.hidden_size, cfg.total_ut_steps, x.dtype)
    else:
        x = state.carry["x"][:n]
        ex = jax.tree.map(lambda a: a[:r], state.carry["exit"])

    def body(depth, carry):
        x, kv, ex = carry
        live = _write_mask(batch, depth)
        h, kv = ouro.loop(params, cfg, x, cos, sin, attn.with_write_mask(live), kv, depth)
        x = jnp.where(live[:, None], h, x)
        last = x[batch.last_token_index]
        gate = ouro.gate_logits(params, last)
        row_live = depth < batch.row_loops
        new_ex = ouro.exit_update(ex, gate, last, depth, batch.row_loops, batch.exit_threshold)
        ex = jax.tree.map(lambda a, b: jnp.where(row_live.reshape(-1, *[1] * (a.ndim - 1)), a, b),
                          new_ex, ex)
        return x, kv, ex

    x, kv, ex = jax.lax.fori_loop(batch.loop_begin, batch.loop_end, body, (x, state.kv, ex))
    if not kind.final:
        carry = {"x": state.carry["x"].at[:n].set(x),
                 "exit": jax.tree.map(lambda c, a: c.at[:r].set(a), state.carry["exit"], ex)}
        return DeviceState(kv, carry), None
    kv = _fill(kv, layout, range(cfg.num_layers), batch, batch.loop_end)
    logits = ouro.lm_head(params, ex.hidden)
    return DeviceState(kv, state.carry), _finish(logits, batch, num_top_logprobs, ex.exit_loop + 1)


def huginn_step(params, state: DeviceState, batch, *, cfg, layout, backend, kind: StepKind,
                num_top_logprobs: int):
    from loopjax.models import huginn
    n = batch.token_ids.shape[0]
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
        e, s, kv = state.carry["e"][:n], state.carry["s"][:n], state.kv

    def body(depth, carry):
        s, kv = carry
        live = _write_mask(batch, depth)
        s_new, kv = huginn.core_loop(params, cfg, s, e, cos, sin, attn.with_write_mask(live), kv,
                                     depth)
        return jnp.where(live[:, None], s_new, s), kv

    s, kv = jax.lax.fori_loop(batch.loop_begin, batch.loop_end, body, (s, kv))
    if not kind.final:
        carry = {"e": state.carry["e"].at[:n].set(e), "s": state.carry["s"].at[:n].set(s)}
        return DeviceState(kv, carry), None
    core = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
    kv = _fill(kv, layout, core, batch, batch.loop_end)
    # NOTE: the coda runs over every token (its KV is needed), lm_head included; only the
    # rows' last tokens are sampled.
    logits, kv = huginn.coda(params, cfg, s, cos, sin, attn, kv)
    loops = jnp.minimum(batch.row_loops, batch.loop_end)
    return DeviceState(kv, state.carry), _finish(logits[batch.last_token_index], batch,
                                                 num_top_logprobs, loops)


def _carry_init(cfg, max_rows: int, dtype) -> dict:
    h = cfg.hidden_size
    if cfg.family == "huginn":
        return {"e": jnp.zeros((max_rows, h), dtype), "s": jnp.zeros((max_rows, h), dtype)}
    from loopjax.models import ouro
    exit_state = ouro.exit_init(max_rows, h, cfg.total_ut_steps, dtype)
    # NOTE: copies, so no two donated leaves share a buffer (exit_init reuses its zeros).
    return {"x": jnp.zeros((max_rows, h), dtype),
            "exit": jax.tree.map(lambda a: jnp.array(a, copy=True), exit_state)}


@dataclass
class StepResult:
    """Host copy of a step's outputs (read back once per submission group)."""

    tokens: np.ndarray       # [R] int32
    exit_loops: np.ndarray   # [R] int32
    logprobs: np.ndarray     # [R] f32
    top_ids: np.ndarray      # [R, k]
    top_logprobs: np.ndarray  # [R, k]
    submissions: int         # device submissions this step took


class Runner:
    """Owns the device state (KV pool + carry) and the compiled step functions."""

    def __init__(self, model, layout: kv_cache.KVLayout, *, decode_rows: tuple[int, ...],
                 prefill_buckets: tuple[tuple[int, int], ...], max_pages: int, max_loops: int,
                 backend: str = "xla", num_top_logprobs: int = 0, strict: bool = False):
        self.cfg, self.params, self.layout = model.cfg, model.params, layout
        self.decode_rows = tuple(sorted(decode_rows))
        self.prefill_buckets = tuple(sorted(prefill_buckets))
        self.max_pages, self.max_loops = max_pages, max_loops
        self.num_top_logprobs, self.strict = num_top_logprobs, strict
        self.compilations, self.warm = 0, False
        dtype = jax.tree.leaves(self.params)[0].dtype
        max_rows = max(self.decode_rows + tuple(r for r, _ in self.prefill_buckets))
        self.state = DeviceState(kv_cache.allocate(layout), _carry_init(self.cfg, max_rows, dtype))
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
        for r in self.decode_rows:
            if r >= num_rows:
                return r
        raise ValueError(f"{num_rows} decode rows exceed the largest bucket {self.decode_rows[-1]}")

    def prefill_bucket(self, num_rows: int, num_tokens: int) -> tuple[int, int]:
        for r, n in self.prefill_buckets:
            if r >= num_rows and n >= num_tokens:
                return r, n
        raise ValueError(f"prefill of {num_rows} rows / {num_tokens} tokens exceeds every bucket")

    # ------------------------------------------------------------------ running
    def run(self, rows: list[RowInput], *, decode: bool, fused: bool = True) -> StepResult:
        """Run one step over `rows`: prefill (packed) or decode (one token per row). Decode
        with fused=False submits one loop at a time. Returns host arrays for the real rows."""
        num_loops = max(r.loops for r in rows)
        if num_loops > self.max_loops or num_loops < 1:
            raise ValueError(f"loops {num_loops} outside 1..{self.max_loops}")
        if decode:
            num_rows = num_tokens = self.decode_bucket(len(rows))
        else:
            num_rows, num_tokens = self.prefill_bucket(len(rows), sum(len(r.token_ids) for r in rows))
        batch = build_step_batch(rows, num_rows=num_rows, num_tokens=num_tokens,
                                 max_pages=self.max_pages, page_size=self.layout.page_size,
                                 drop_slot=self.layout.drop_slot, loop_begin=0, loop_end=num_loops,
                                 hidden_size=self._hidden)
        out, submissions = self._submit(batch, num_loops, fused or not decode)
        host = jax.device_get(out)  # the one host read of this step
        k = len(rows)
        return StepResult(host.tokens[:k], host.exit_loops[:k], host.logprobs[:k],
                          host.top_ids[:k], host.top_logprobs[:k], submissions)

    def _submit(self, batch, num_loops: int, fused: bool):
        batch = jax.device_put(batch)
        if fused:
            self.state, out = self._step(self.params, self.state, batch, StepKind(True, True))
            return out, 1
        out = None
        for t in range(num_loops):
            kind = StepKind(first=t == 0, final=t == num_loops - 1)
            b = dataclasses.replace(batch, loop_begin=jnp.int32(t), loop_end=jnp.int32(t + 1))
            self.state, out = self._step(self.params, self.state, b, kind)
        return out, num_loops

    def warmup(self, *, unfused: bool = False) -> int:
        """Compile (by running all-padding batches) every decode and prefill bucket; with
        unfused, also the one-loop decode variants. Returns the compile count."""
        def dummy(num_rows, num_tokens, loop_end):
            return build_step_batch([], num_rows=num_rows, num_tokens=num_tokens,
                                    max_pages=self.max_pages, page_size=self.layout.page_size,
                                    drop_slot=self.layout.drop_slot, loop_begin=0,
                                    loop_end=loop_end, hidden_size=self._hidden)
        outs = []
        for r in self.decode_rows:
            outs.append(self._submit(dummy(r, r, self.max_loops), self.max_loops, True)[0])
            if unfused and self.max_loops > 1:
                outs.append(self._submit(dummy(r, r, 3), 3, False)[0])
        for r, n in self.prefill_buckets:
            outs.append(self._submit(dummy(r, n, self.max_loops), self.max_loops, True)[0])
        jax.block_until_ready((outs, self.state))
        self.warm = True
        return self.compilations


def default_row_input(token_ids, start_pos, pages, *, loops: int, emits: bool = True,
                      params: SamplingParams | None = None, **kw: Any) -> RowInput:
    """A RowInput with greedy defaults (tests, benchmarks)."""
    return RowInput(list(token_ids), start_pos, list(pages), emits, loops,
                    params or SamplingParams(temperature=0.0, seed=0), **kw)
