"""Slow, obviously-correct host-driven references of adaptive-exit generation (test oracles).

One sequence, greedy, one jitted call per loop driven by a Python loop over tokens and
loops, and a dense KV store with an explicit "written" mark per (cache layer, plane,
position). The model math is `models.huginn` / `models.ouro`; only the attention backend
(`DenseStore`) and the exit bookkeeping live here. Every cache rule shares one compiled
store shape (planes = max loops; a ring uses its first K / R planes).

Huginn (`huginn_generate`), as the reference's `generate_with_adaptive_compute` does it:
- call 0 is the prefill: every prompt token runs the same loops and they exit together (the
  logit criteria look at the last position, latent-diff / cosine average over positions);
  call k > 0 decodes one token. `loops[k]` is call k's exit loop count (`loops_run[k]`
  the loops it ran: the same in "skip" mode, the reference's; all of them in "select").
- after each loop the exit criterion (`loopjax.exits`) is checked; the logit criteria run
  the coda (with its KV writes) on the checked loop; the emitted logits are the coda of the
  selected state (the exit loop's, or the last loop's), which also leaves the coda KV.
  NOTE: the reference instead emits the last *checked* loop's logits when check_every > 1
  leaves the last loop unchecked; the goldens check every loop, where the two agree.
- cache rules (the reference's `HuginnDynamicCache` lookup strategies), for core layers:
  `full`: plane = loop; a read sees only the entries written at that plane (a token that
  exited earlier is absent, as the reference's stacking of the present entries does).
  `latest-m4`: plane = loop; a token with no entry at the plane is read at its deepest
  plane below it ("last exited"; the reference's slot ≡ idx mod 4 rule, i.e. same layer).
  `compress-sK` / `latest-m4-compress-sK`: a ring of K layer slots, plane = loop mod
  (K / core layers), the last writer of a slot wins; with latest-m4 a missing entry is read
  at the deepest lower plane it wrote. Prelude and coda layers have one plane (the coda's
  entry is rewritten by every coda run of the token: the last writer wins).
- warm start: None (explicit s_0 per position), "ln_f" (the next token starts from ln_f of
  the previous token's final state: `generate_minimal(continuous_compute=True)` and
  loopjax's choice) or "raw" (the raw final state: the reference's adaptive path).

Ouro (`ouro_generate`): threshold exit with `ouro.exit_update` per token. "select": every
loop runs and the rule picks the logits (the reference). "skip": a decoded token stops at
its exit loop and is read at deeper loops at its deepest plane ("last exited"); prompt
tokens always run every loop (they need their per-loop planes). `loops[k]` is the selected
exit loop + 1 of generated token k (for the prefill, the last prompt position's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import exits
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, causal_attention, rms_norm, rope_angles
from loopjax.models import huginn, ouro

CACHE_RULES = ("full", "latest-m4", "compress-sK", "latest-m4-compress-sK")
WARM_STARTS = (None, "ln_f", "raw")
MODES = ("skip", "select")


@dataclass(frozen=True)
class StoreLayout:
    """Static shape of the dense store (the jit key: every cache rule shares it)."""

    num_planes: tuple[int, ...]  # planes per cache layer (looped layers: the max loop count)
    max_len: int                 # positions held
    num_kv_heads: int
    head_dim: int


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ReadRule:
    """The cache rule as traced scalars (so one compile serves every rule)."""

    latest: jax.Array  # bool: read a missing entry at its deepest lower plane ("last exited")
    ring: jax.Array    # i32: looped layers use plane depth mod ring (0: plane = depth)


@jax.tree_util.register_dataclass
@dataclass
class DenseKV:
    k: tuple          # per cache layer [planes, max_len, Hkv, D]
    v: tuple
    written: tuple    # per cache layer [planes, max_len] bool


def empty_store(layout: StoreLayout, dtype) -> DenseKV:
    shape = lambda p: (p, layout.max_len, layout.num_kv_heads, layout.head_dim)
    return DenseKV(tuple(jnp.zeros(shape(p), dtype) for p in layout.num_planes),
                   tuple(jnp.zeros(shape(p), dtype) for p in layout.num_planes),
                   tuple(jnp.zeros((p, layout.max_len), bool) for p in layout.num_planes))


@dataclass(frozen=True)
class DenseStore:
    """`attn(kv, layer_id, depth, q, k, v)` over a DenseKV: write this call's tokens at their
    positions of the layer's plane, then attend causally to every position's entry chosen by
    the read rule."""

    layout: StoreLayout
    rule: ReadRule
    positions: jax.Array  # [N] positions of this call's tokens

    def __call__(self, kv: DenseKV, layer_id, depth, q, k, v):
        planes, max_len = self.layout.num_planes[layer_id], self.layout.max_len
        depth = jnp.asarray(depth, jnp.int32)
        if planes == 1:
            plane = jnp.int32(0)
        else:  # NOTE: with a ring the planes past it are never written, so never read
            plane = jnp.where(self.rule.ring > 0, depth % jnp.maximum(self.rule.ring, 1), depth)
        keys = kv.k[layer_id].at[plane, self.positions].set(k.astype(kv.k[layer_id].dtype))
        vals = kv.v[layer_id].at[plane, self.positions].set(v.astype(kv.v[layer_id].dtype))
        written = kv.written[layer_id].at[plane, self.positions].set(True)
        below = written & (jnp.arange(planes)[:, None] <= plane)            # [planes, L]
        deepest = planes - 1 - jnp.argmax(below[::-1], axis=0)               # per position
        source = jnp.where(self.rule.latest, deepest, plane)
        valid = jnp.where(self.rule.latest, jnp.any(below, axis=0), written[plane])
        pos = jnp.arange(max_len)
        mask = valid[None, :] & (pos[None, :] <= self.positions[:, None])
        out = causal_attention(q, keys[source, pos], vals[source, pos], mask)
        kv = DenseKV(_swap(kv.k, layer_id, keys), _swap(kv.v, layer_id, vals),
                     _swap(kv.written, layer_id, written))
        return kv, out


def _swap(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1:]


@dataclass
class AdaptiveResult:
    tokens: np.ndarray     # [max_new] int32 greedy tokens
    loops: np.ndarray      # [max_new] int32 exit loop count of each call's emitted token
    logits: np.ndarray     # [max_new, V] f32 emitted logits
    loops_run: np.ndarray  # [max_new] int32 loops each call ran (the work; = loops in skip)


# ------------------------------------------------------------------------------ Huginn

def parse_cache_rule(rule: str, cfg) -> tuple[bool, int | None]:
    """(latest, ring planes or None) of a Huginn cache rule name."""
    m = re.fullmatch(r"(latest-m4|full)?-?(?:compress-s(\d+))?", rule)
    if not rule or m is None or (m.group(1) == "full" and m.group(2)):
        raise ValueError(f"unknown cache rule {rule!r}; use one of {', '.join(CACHE_RULES)}")
    slots = m.group(2)
    if slots is not None and (int(slots) % cfg.num_core_layers or int(slots) == 0):
        raise ValueError(f"cache rule {rule!r}: K={slots} must be a positive multiple of the "
                         f"{cfg.num_core_layers} core layers")
    return m.group(1) == "latest-m4", None if slots is None else int(slots) // cfg.num_core_layers


def huginn_layout(cfg, max_loops: int, max_len: int) -> StoreLayout:
    pre, core, coda = cfg.num_prelude_layers, cfg.num_core_layers, cfg.num_coda_layers
    return StoreLayout((1,) * pre + (max_loops,) * core + (1,) * coda, max_len,
                       cfg.num_kv_heads, cfg.head_dim)


def read_rule(latest: bool, ring: int | None) -> ReadRule:
    return ReadRule(jnp.asarray(latest), jnp.asarray(ring or 0, jnp.int32))


@partial(jax.jit, static_argnames=("cfg", "layout"))
def _huginn_prelude(params, cfg, layout, rule, kv, ids, positions):
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_base)
    x = huginn.embed(params, cfg, ids)
    return huginn.prelude(params, cfg, x, cos, sin, DenseStore(layout, rule, positions), kv)


@partial(jax.jit, static_argnames=("cfg", "layout"))
def _huginn_core(params, cfg, layout, rule, kv, s, e, positions, depth):
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_base)
    attn = DenseStore(layout, rule, positions)
    return huginn.core_loop(params, cfg, s, huginn.inject(params, e), cos, sin, attn, kv, depth)


@partial(jax.jit, static_argnames=("cfg", "layout"))
def _huginn_coda(params, cfg, layout, rule, kv, s, positions):
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_base)
    logits, kv = huginn.coda(params, cfg, s, cos, sin, DenseStore(layout, rule, positions), kv)
    return logits.astype(jnp.float32), kv


# The criteria run jitted here too (one compile per logits/no-logits variant).
_exit_update = jax.jit(exits.update)
_needs_logits = jax.jit(exits.needs_logits)
_NO_EXIT = exits.ExitSpec()


def huginn_generate(params, cfg, prompt_ids, max_new_tokens: int, *, max_loops: int,
                    init_states, exit_spec: exits.ExitSpec | list = _NO_EXIT,
                    cache_rule: str = "latest-m4", warm_start: str | None = None,
                    mode: str = "skip") -> AdaptiveResult:
    """Greedy Huginn generation with per-call adaptive exit (see the module doc).

    init_states [>= T + max_new - 1, H]: s_0 per position (prefill rows first; with a warm
    start only the prompt's rows are used). exit_spec: one ExitSpec for every call, or a list
    with one per call (e.g. `ExitSpec("steps", n)` per call replays an exit trace).
    mode "skip" (the reference): a call stops at its exit. "select": every call runs all
    `max_loops` loops (its core KV written at every plane) and the exit loop's state is the
    one emitted, fed to the coda (whose KV it writes) and warm-started from."""
    prompt_ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    num_prompt = prompt_ids.shape[0]
    specs = exit_spec if isinstance(exit_spec, list | tuple) else [exit_spec] * max_new_tokens
    if len(specs) != max_new_tokens or max_new_tokens < 1 or max_loops < 1:
        raise ValueError(f"huginn_generate: need max_new_tokens >= 1, max_loops >= 1 and one "
                         f"exit spec per call; got {max_new_tokens}, {max_loops}, {len(specs)}")
    if warm_start not in WARM_STARTS or mode not in MODES:
        raise ValueError(f"huginn_generate: warm_start must be one of {WARM_STARTS} and mode "
                         f"one of {MODES}; got {warm_start!r}, {mode!r}")
    dtype = params["embed"].dtype
    init_states = jnp.asarray(init_states, dtype)
    needed = num_prompt if warm_start else num_prompt + max_new_tokens - 1
    if init_states.ndim != 2 or init_states.shape[0] < needed:
        raise ValueError(f"huginn_generate: init_states needs shape [>= {needed}, H], got "
                         f"{init_states.shape}")
    rule = read_rule(*parse_cache_rule(cache_rule, cfg))
    layout = huginn_layout(cfg, max_loops, num_prompt + max_new_tokens)
    kv = empty_store(layout, dtype)
    ids, start, warm = prompt_ids, 0, None
    tokens, loops, loops_run, emitted = [], [], [], []
    for spec in specs:
        positions = jnp.arange(start, start + len(ids), dtype=jnp.int32)
        s0 = init_states[start:start + len(ids)] if warm is None else warm
        kv, s, logits, exit_loops, run = _huginn_call(params, cfg, layout, rule, kv, ids, positions,
                                                      s0, spec, max_loops, mode)
        tokens.append(int(jnp.argmax(logits[-1])))
        loops.append(exit_loops)
        loops_run.append(run)
        emitted.append(np.asarray(logits[-1]))
        if warm_start is not None:
            warm = s[-1:] if warm_start == "raw" else rms_norm(s[-1:], params["ln_f"], cfg.norm_eps)
        ids, start = np.asarray([tokens[-1]], np.int32), start + len(ids)
    return AdaptiveResult(np.asarray(tokens, np.int32), np.asarray(loops, np.int32),
                          np.stack(emitted), np.asarray(loops_run, np.int32))


def _huginn_call(params, cfg, layout, rule, kv, ids, positions, s0, spec, max_loops, mode):
    """One call (prefill or one decoded token), one loop at a time. Returns (kv, emitted
    state s [N, H], logits [N, V] f32 of s, exit loop count, loops run)."""
    e, kv = _huginn_prelude(params, cfg, layout, rule, kv, jnp.asarray(ids), positions)
    p = exits.exit_params([spec])
    state, row = exits.init(p, s0, cfg.vocab_size), jnp.zeros(len(ids), jnp.int32)
    s, selected, logits, logits_loop = s0, None, None, -1
    for depth in range(max_loops):
        s, kv = _huginn_core(params, cfg, layout, rule, kv, s, e, positions, depth)
        if selected is not None:
            continue  # select mode after the exit: the loop only writes its KV
        last = None
        if bool(_needs_logits(p, state, depth)):
            logits, kv = _huginn_coda(params, cfg, layout, rule, kv, s, positions)
            logits_loop, last = depth, logits[-1:]
        state, exit_now = _exit_update(state, p, last, s, depth, row_of_token=row)
        if bool(exit_now[0]) or depth == max_loops - 1:
            selected = (s, depth + 1)
            if mode == "skip":
                break
    s, exit_loops = selected
    if logits_loop != exit_loops - 1:  # the coda (and its KV) has not seen this state yet
        logits, kv = _huginn_coda(params, cfg, layout, rule, kv, s, positions)
    return kv, s, logits, exit_loops, depth + 1


# -------------------------------------------------------------------------------- Ouro

def ouro_layout(cfg, max_len: int) -> StoreLayout:
    n = cfg.num_layers
    return StoreLayout((cfg.total_ut_steps,) * n, max_len, cfg.num_kv_heads, cfg.head_dim)


@partial(jax.jit, static_argnames=("cfg", "layout"), compiler_options=IDENTITY_COMPILER_OPTIONS)
def _ouro_loop(params, cfg, layout, kv, x, positions, depth, ex, threshold):
    """One Ouro loop over this call's tokens ("last exited" reads), then the exit rule."""
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    attn = DenseStore(layout, read_rule(True, None), positions)
    h, kv = ouro.loop(params, cfg, x, cos, sin, attn, kv, depth)
    ex = ouro.exit_update(ex, ouro.gate_logits(params, h), h, depth, cfg.total_ut_steps, threshold)
    return h, kv, ex


@partial(jax.jit, compiler_options=IDENTITY_COMPILER_OPTIONS)
def _ouro_head(params, hidden):
    return ouro.lm_head(params, hidden).astype(jnp.float32)


def ouro_generate(params, cfg, prompt_ids, max_new_tokens: int, *, threshold: float,
                  mode: str = "select") -> AdaptiveResult:
    """Greedy Ouro generation with the threshold exit (module doc)."""
    if mode not in MODES:
        raise ValueError(f"ouro_generate: mode must be one of {MODES}, got {mode!r}")
    prompt_ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    num_loops = cfg.total_ut_steps
    layout = ouro_layout(cfg, prompt_ids.shape[0] + max_new_tokens)
    dtype = params["embed"].dtype
    kv = empty_store(layout, dtype)
    ids, start = prompt_ids, 0
    tokens, loops, loops_run, emitted = [], [], [], []
    for call in range(max_new_tokens):
        positions = jnp.arange(start, start + len(ids), dtype=jnp.int32)
        x = ouro.embed(params, jnp.asarray(ids))
        ex = ouro.exit_init(len(ids), cfg.hidden_size, num_loops, dtype)
        for depth in range(num_loops):
            x, kv, ex = _ouro_loop(params, cfg, layout, kv, x, positions, depth, ex,
                                   jnp.float32(threshold))
            if mode == "skip" and call and bool(ex.exited[-1]):
                break
        logits = _ouro_head(params, ex.hidden[-1:])[0]
        tokens.append(int(jnp.argmax(logits)))
        loops.append(int(ex.exit_loop[-1]) + 1)
        loops_run.append(depth + 1)
        emitted.append(np.asarray(logits))
        ids, start = np.asarray([tokens[-1]], np.int32), start + len(ids)
    return AdaptiveResult(np.asarray(tokens, np.int32), np.asarray(loops, np.int32),
                          np.stack(emitted), np.asarray(loops_run, np.int32))


__all__ = ["AdaptiveResult", "CACHE_RULES", "DenseKV", "DenseStore", "ReadRule", "StoreLayout",
           "empty_store", "huginn_generate", "huginn_layout", "ouro_generate", "ouro_layout",
           "parse_cache_rule", "read_rule"]
