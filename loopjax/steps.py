"""Jitted device steps: pure `(params, state, batch) -> (state, out)`, the state donated
(loopjax/runner.py jits, compiles and submits them).

One step function per family serves prefill (N packed prompt tokens over R rows) and decode
(N = R): it runs loops loop_begin .. loop_begin + num_loops - 1 inside ONE `lax.fori_loop`
(Ouro: every layer per loop plus the exit-gate carry, lm_head once on the selected state;
Huginn: prelude, the recurrent loops, coda), then samples on device. The loop count is a
static trip count (`StepKind.num_loops`): a traced bound would make XLA read the loop
predicate back to the host every loop. `per_loop` kinds cut a decode into one-loop
submissions (a per-loop series): the loop state between submissions stays on device in
`DeviceState.carry` (indexed by each request's carry slot), never on the host.

A token the host has not read yet reaches the next step through `DeviceState.last_tokens`
(each emitting row writes its slot, `StepBatch.token_from_device` tokens read it).

Rows past their own loop count (`row_loops`) freeze their state and write no KV (fixed-depth
requests never read those planes; `kv_cache.fill_last_exited` is for adaptive exits).
Padding rows write only to the drop slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from loopjax import kv_cache, penalties
from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, INIT_WARM
from loopjax.kv_cache import DeviceState
from loopjax.layers import rms_norm, rope_angles
from loopjax.sampling import sample


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
    greedy: bool = False      # every real row is greedy: tokens by argmax, no filters, sort or noise


def fused(num_loops: int, adaptive: bool = False, unroll: int = 1, weighted: bool = False, *,
          greedy: bool = False) -> StepKind:  # one submission
    return StepKind(num_loops, adaptive=adaptive, unroll=unroll, weighted=weighted, greedy=greedy)


def per_loop(first: bool, final: bool) -> StepKind:
    """One loop of a per-loop decode series; the loop state stays on device between them."""
    return StepKind(1, first, final, save_carry=True)


def fused_kind(num_loops: int, *, decode: bool, all_greedy: bool, adaptive: bool = False,
              unroll: int = 1, weighted: bool = False) -> StepKind:
    """The fused kind a step over such rows runs: the one rule that Runner.dispatch follows and
    Runner.warmup_steps compiles. Decode steps whose rows are all plain greedy (no penalties,
    logit_bias or top logprobs: SamplingParams.is_plain_greedy) take the greedy sampler (its
    sort alone is ~0.23 ms of the 8.7 ms Ouro-1.4B 32-row step, run 16); prefill keeps one
    executable per bucket, as its sampler is a small part of it."""
    return fused(num_loops, adaptive, unroll, weighted, greedy=decode and all_greedy)


@jax.tree_util.register_dataclass
@dataclass
class StepOut:  # device outputs of a step
    tokens: jax.Array       # [R] i32 sampled token per row (garbage for non-emitting rows)
    exit_loops: jax.Array   # [R] i32 loops of the selected state (1-based)
    logprobs: jax.Array     # [R] f32 log-prob of the sampled token
    top_ids: jax.Array      # [R, k] i32
    top_logprobs: jax.Array  # [R, k] f32
    ranks: jax.Array        # [R] i32 the sampled token's rank (sampling.py: vLLM's rule)


def _put(buffer, slots, values):  # buffer[slots] = values (padding rows: the spare last slot)
    return buffer.at[slots].set(values)


def _input_ids(state: DeviceState, batch):
    """[N] the step's token ids: a token sampled by a step still in flight comes from its row's
    last-token slot (the host has not read it), the others from the batch."""
    from_slot = state.last_tokens[batch.token_slot[batch.row_of_token]]
    return jnp.where(batch.token_from_device, from_slot, batch.token_ids)


def _finish(state: DeviceState, kv, carry, logits, batch, num_top_logprobs, exit_loops, kind):
    """Sample (logits in the model dtype: `sample` sorts 16-bit keys of 16-bit logits); each
    emitting row's token also goes to its last-token slot (others: the spare). The full
    samplers also start the token histories a prefill batch resets, read the rows' histories
    (penalties, logit_bias) and count the tokens in them (loopjax/penalties.py)."""
    spare = state.last_tokens.shape[0] - 1
    slots = jnp.where(batch.row_is_real, batch.token_slot, spare)
    history, rows = state.history, None
    if not kind.greedy:
        if batch.history_reset is not None:
            history = penalties.reset(history, batch.token_slot, batch.history_reset)
        rows = penalties.rows_of(history, slots)
    # A decode row's last output token is in its slot (its input); a prefill row's bans are
    # all outright (the host has its whole output: bad_words.py).
    tokens, logprobs, top_ids, top_lp, ranks = sample(logits, batch.sampling, greedy=kind.greedy,
                                               num_top_logprobs=num_top_logprobs, history=rows,
                                               prev_tokens=state.last_tokens[slots])
    if not kind.greedy:
        history = penalties.record(history, slots, tokens)
    state = DeviceState(kv, carry, _put(state.last_tokens, slots, tokens), history)
    return state, StepOut(tokens, exit_loops, logprobs, top_ids, top_lp, ranks)


def _depth_loop(kind: StepKind, batch, body, carry, done):
    """Loops loop_begin.. of `body(depth, carry)`: a static trip count, or (adaptive) a
    while_loop that also ends once every row is `done(carry)` [R] or past its own loop count
    (an exit trace or a smaller fixed depth: such rows are frozen, so stopping early changes
    nothing but the work; padding rows have 0 loops). A prompt chunk that samples nothing
    (not `row_is_real`) still runs its loops: later chunks read its KV at every plane."""
    if not kind.adaptive:
        return jax.lax.fori_loop(0, kind.num_loops, lambda i, c: body(batch.loop_begin + i, c), carry,
                                 unroll=kind.unroll)

    def go(c):
        finished = done(c[1]) | (batch.loop_begin + c[0] >= batch.row_loops)
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
        return dataclasses.replace(state, kv=kv, carry=carry), None
    if kind.adaptive:
        kv = kv_cache.fill_rows(kv, layout, range(cfg.num_layers), batch, ex.exit_loop)
    logits = ops.linear(ex.hidden, params["lm_head"])  # ouro.lm_head through the ops seam
    if kind.weighted:
        logits = jnp.where(batch.exit_weighted[:, None], acc, logits)
    return _finish(state, kv, carry, logits, batch, num_top_logprobs, ex.exit_loop + 1, kind)


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
    injected = huginn.inject(params, e)  # e's part of the adapter: once per step, not per loop
    # Adaptive: criteria state; `sel` the selected (exit loop's) state; `ran` its loop count.
    xs = exits.init(batch.exit, s, cfg.vocab_size) if kind.adaptive else None
    ran = jnp.zeros(batch.row_loops.shape, jnp.int32)

    def body(depth, carry):
        s, kv, xs, sel, ran = carry
        exited = xs.exited if kind.adaptive else jnp.zeros_like(batch.exit_skip)
        row_live = (depth < batch.row_loops) & ~(exited & batch.exit_skip)
        live = row_live[batch.row_of_token]
        s_new, kv = huginn.core_loop(params, cfg, s, injected, cos, sin, attn.with_write_mask(live), kv,
                                     depth, ops)
        s = jnp.where(live[:, None], s_new, s)
        if kind.adaptive:  # the logit criteria need the coda (with its KV writes) on checked loops
            logits, kv = jax.lax.cond(
                exits.needs_logits(batch.exit, xs, depth, active=row_live),
                lambda kv: huginn.coda(params, cfg, s, cos, sin, attn, kv, ops, logit_rows=last),
                lambda kv: (jnp.zeros((last.shape[0], cfg.vocab_size), dtype), kv), kv)
            xs, _ = exits.update(xs, batch.exit, logits, s, depth, row_of_token=batch.row_of_token,
                                 active=row_live, real_token=batch.slot_mapping != layout.drop_slot)
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
        return dataclasses.replace(state, kv=kv, carry=carry), None
    if kind.adaptive:
        core = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
        kv = kv_cache.fill_rows(kv, layout, core, batch, ran - 1)
    # NOTE: the coda of the selected state runs over every token (its KV is the one later
    # tokens read); lm_head only over the rows' last tokens, the ones sampled.
    logits, kv = huginn.coda(params, cfg, sel, cos, sin, attn, kv, ops, logit_rows=last)
    # Warm start: the next token of a row starts from ln_f of this token's selected state.
    warm = rms_norm(sel[last], params["ln_f"], cfg.norm_eps)
    carry = {**carry, "warm": _put(carry["warm"], batch.carry_slot, warm)}
    loops = ran if kind.first else jnp.minimum(batch.row_loops, batch.loop_end)
    return _finish(state, kv, carry, logits, batch, num_top_logprobs, loops, kind)
