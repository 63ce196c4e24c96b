"""Huginn per-token adaptive exit criteria, jit-friendly, for the fused decode loop.

Each criterion compares the state after a loop with the state at the previous *check* and
answers, per row, "exit now". Semantics, formulas and "auto" thresholds follow the
reference's exit evaluators (seal-rg/recurrent-pretraining `raven_modeling_minimal.py`,
`generate_with_adaptive_compute`; the goldens' README records the revision):

  criterion         value compared at a check                         exits when   auto
  kl                KL(p_prev || p) = Σ p_prev·(log p_prev − log p)   value < thr  1e-3
  minp-kl           the same KL on min-p-filtered distributions (*)   value < thr  1e-5
  entropy-diff      |H(p) − H(p_prev)|, H = −Σ p·log(p + 1e-10)       value < thr  1e-3
  argmax-stability  consecutive checks with an unchanged argmax       count >= thr 5
  latent-diff       mean over the row's tokens of ‖s − s_prev‖/‖s‖    value < thr  0.03
  cosine            1 − mean over the row's tokens of cos(s, s_prev)  value < thr  1e-3
  steps             loops run so far (replays a recorded exit trace)  loops >= thr (none)
  none              never exits early

  (*) p' = p where p >= 0.1·max(p), else 1/V; renormalised.

p = softmax of the row's last-token logits, in fp32 (`log_softmax` for kl). Before the
first check: p_prev = uniform (log(1/V)), H_prev = 100, argmax_prev = -1 (so the first check
counts 0), s_prev = s_0 (the initial state). The previous values advance at every check,
not at every loop: with `check_every` > 1 a check compares with the previous check.

KL threshold: the paper (arXiv 2502.05171) uses 5e-4 (`PAPER_KL_THRESHOLD`); the
reference's "auto" is 1e-3 (`AUTO_THRESHOLDS["kl"]`). loopjax's default ("auto") is the
reference's 1e-3, so default runs are token-identical to the reference.

Loop counting: `loop_idx` is the 0-based index of the loop just run. A check happens after
loop n = loop_idx + 1 when n >= min_loops and (n − min_loops) % check_every == 0; the
reference's `min_steps` is min_loops − 1 (its default 0 = loopjax's min_loops 1). A row that
exits at loop_idx has run loop_idx + 1 loops.

Logits: `LOGIT_CRITERIA` (kl, minp-kl, entropy-diff, argmax-stability) need the coda and
lm_head on every checked loop; latent-diff, cosine, steps and none need only the state.
`needs_logits(params, state, loop_idx)` says whether any live row needs them this loop.

Fused-loop use (one `lax.while_loop` over depth, carry (s, kv, ExitState, done, selected)):
after `core_loop`, if `needs_logits(params, state, depth, active=~done)` run the coda over the
step's tokens (prefill: all of a row's tokens, its last one is checked) under `lax.cond`,
else pass None/zeros; `update(..., active=~done)`; a row is done when `exit_now` or
depth + 1 reaches its max loops; keep the done loop's s as its selected state; stop when
every row is done. The coda of the selected state runs once more after the loop (its KV is
the one later tokens read; a check-time coda gives the same logits for the same state).

Shapes: R rows, N tokens (decode: N = R, token r is row r; prefill: the packed tokens with
`row_of_token [N]`, the latent criteria averaging over each row's tokens, as the reference
does over the prompt). Settings are per row (`ExitParams`, arrays [R]), so one compiled
loop serves any mix of criteria; every formula is evaluated and the row's kind selects.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

CRITERIA = ("none", "kl", "entropy-diff", "latent-diff", "argmax-stability", "cosine",
            "minp-kl", "steps")
NONE, KL, ENTROPY_DIFF, LATENT_DIFF, ARGMAX_STABILITY, COSINE, MINP_KL, STEPS = range(8)
LOGIT_CRITERIA = frozenset({"kl", "entropy-diff", "argmax-stability", "minp-kl"})
_LOGIT_KINDS = (KL, ENTROPY_DIFF, ARGMAX_STABILITY, MINP_KL)

PAPER_KL_THRESHOLD = 5e-4
# The reference's exit_threshold="auto" per criterion (argmax-stability: a count of checks).
AUTO_THRESHOLDS = {"none": 1.0, "kl": 1e-3, "minp-kl": 1e-5, "entropy-diff": 1e-3,
                   "latent-diff": 0.03, "cosine": 1e-3, "argmax-stability": 5}
ENTROPY_EPS = 1e-10        # inside the log of the entropy
INITIAL_ENTROPY = 100.0    # H_prev before the first check
MINP_RATIO = 0.1           # min-p filter of minp-kl: keep p >= 0.1 * max p


@dataclass(frozen=True)
class ExitSpec:
    """One request's exit settings (host side, validated on creation)."""

    criterion: str = "none"
    threshold: float | str = "auto"  # a number, or "auto" (AUTO_THRESHOLDS)
    min_loops: int = 1               # no check before this many loops (reference min_steps + 1)
    check_every: int = 1             # check every this many loops from min_loops on

    def __post_init__(self):
        if self.criterion not in CRITERIA:
            raise ValueError(f"exit criterion must be one of {', '.join(CRITERIA)}, "
                             f"got {self.criterion!r}")
        if self.threshold == "auto":
            if self.criterion == "steps":
                raise ValueError("exit criterion 'steps' needs a loop count as threshold, not 'auto'")
        elif isinstance(self.threshold, bool) or not isinstance(self.threshold, numbers.Real) \
                or not np.isfinite(self.threshold):
            raise ValueError(f"exit threshold must be a finite number or 'auto', got "
                             f"{self.threshold!r}")
        for name in ("min_loops", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"exit {name} must be an integer >= 1, got {value!r}")

    @property
    def threshold_value(self) -> float:
        """The threshold as used: "auto" resolved; argmax-stability's truncated to an int
        (the reference's int(threshold))."""
        value = AUTO_THRESHOLDS[self.criterion] if self.threshold == "auto" else self.threshold
        return float(int(value)) if self.criterion == "argmax-stability" else float(value)

    @property
    def needs_logits(self) -> bool:
        return self.criterion in LOGIT_CRITERIA


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExitParams:
    """Per-row exit settings on device."""

    kind: jax.Array         # [R] i32 index into CRITERIA
    threshold: jax.Array    # [R] f32 (rounded to f32, as torch compares with a Python float)
    min_loops: jax.Array    # [R] i32 >= 1
    check_every: jax.Array  # [R] i32 >= 1


def exit_params(specs: Sequence[ExitSpec], num_rows: int | None = None) -> ExitParams:
    """ExitParams of `specs`, padded to `num_rows` with never-exiting rows."""
    num_rows = len(specs) if num_rows is None else num_rows
    if num_rows < len(specs):
        raise ValueError(f"exit_params: {len(specs)} specs do not fit {num_rows} rows")
    specs = list(specs) + [ExitSpec()] * (num_rows - len(specs))
    # NOTE: a request may send any integer: past the depth, a larger min_loops (no check) or
    # check_every (one check, at min_loops) changes nothing, so they are capped to the int32
    # range (2**31 overflowed here, in the engine thread, and killed the engine).
    big = np.iinfo(np.int32).max
    return ExitParams(
        kind=jnp.asarray([CRITERIA.index(s.criterion) for s in specs], jnp.int32).reshape(num_rows),
        threshold=jnp.asarray([s.threshold_value for s in specs], jnp.float32).reshape(num_rows),
        min_loops=jnp.asarray([min(s.min_loops, big) for s in specs], jnp.int32).reshape(num_rows),
        check_every=jnp.asarray([min(s.check_every, big) for s in specs], jnp.int32).reshape(num_rows))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExitState:
    """The carry of the criteria (one per row, the latent one per token)."""

    prev_log_probs: jax.Array  # [R, V] f32 log p_prev (kl, minp-kl); uniform at first
    prev_entropy: jax.Array    # [R] f32 H_prev (entropy-diff); INITIAL_ENTROPY at first
    prev_argmax: jax.Array     # [R] i32 (argmax-stability); -1 at first
    stable: jax.Array          # [R] i32 consecutive checks with an unchanged argmax
    prev_latent: jax.Array     # [N, H] f32 s_prev (latent-diff, cosine); s_0 at first
    exited: jax.Array          # [R] bool a check fired for the row (it then stays frozen)


def init(params: ExitParams, initial_latent, vocab_size: int) -> ExitState:
    """The state before loop 0. initial_latent [N, H]: s_0 of every token."""
    r = params.kind.shape[0]
    return ExitState(
        prev_log_probs=jnp.log(jnp.full((r, vocab_size), 1.0 / vocab_size, jnp.float32)),
        prev_entropy=jnp.full((r,), INITIAL_ENTROPY, jnp.float32),
        prev_argmax=jnp.full((r,), -1, jnp.int32), stable=jnp.zeros((r,), jnp.int32),
        prev_latent=jnp.asarray(initial_latent, jnp.float32), exited=jnp.zeros((r,), bool))


def is_check(params: ExitParams, loop_idx) -> jax.Array:
    """[R] bool: the rule is evaluated after loop `loop_idx` (0-based, may be traced)."""
    n = jnp.asarray(loop_idx, jnp.int32) + 1
    return (n >= params.min_loops) & ((n - params.min_loops) % params.check_every == 0)


def needs_logits(params: ExitParams, state: ExitState, loop_idx, active=None) -> jax.Array:
    """Scalar bool: some live row checks a logit criterion after `loop_idx` (run the coda)."""
    wants = jnp.isin(params.kind, jnp.asarray(_LOGIT_KINDS, jnp.int32))
    live = ~state.exited if active is None else ~state.exited & active
    return jnp.any(wants & is_check(params, loop_idx) & live)


def _kl(prev_log_probs, log_probs):
    """KL(p_prev || p) per row: torch's kl_div(log p, log p_prev, log_target=True).sum(-1)."""
    return jnp.sum(jnp.exp(prev_log_probs) * (prev_log_probs - log_probs), axis=-1)


def _minp_log_probs(probs):
    """log of the min-p-filtered distribution of minp-kl (probs [R, V] f32)."""
    vocab = probs.shape[-1]
    keep = probs >= MINP_RATIO * jnp.max(probs, axis=-1, keepdims=True)
    masked = jnp.where(keep, probs, jnp.float32(1.0 / vocab))
    return jnp.log(masked / jnp.sum(masked, axis=-1, keepdims=True))


def _row_mean(values, row_of_token, num_rows: int, real=None):
    """Mean of per-token values [N] over each row's real tokens -> [R] (inf for empty rows)."""
    if row_of_token is None:
        return values
    weight = jnp.ones_like(values) if real is None else real.astype(values.dtype)
    total = jax.ops.segment_sum(jnp.where(weight > 0, values, 0), row_of_token, num_segments=num_rows)
    count = jax.ops.segment_sum(weight, row_of_token, num_segments=num_rows)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.inf)


def update(state: ExitState, params: ExitParams, logits, latent, loop_idx, *,
           row_of_token=None, active=None, real_token=None) -> tuple[ExitState, jax.Array]:
    """Fold loop `loop_idx` into the criteria; returns (state, exit_now [R] bool).

    logits [R, V] (any float dtype; used in fp32): each row's last-token logits of this loop,
    or None when no row needs them (`needs_logits` false): logit criteria then neither fire
    nor advance. latent [N, H]: this loop's raw states s (before ln_f; norms and dot
    products in fp32, the reference's are in the model dtype). row_of_token [N]:
    the row of each token (None: N = R, token r is row r); real_token [N] bool (None: all):
    the latent means skip the others (a bucket's padding tokens carry row 0's id, and would
    make row 0's exit depend on the bucket). active [R]: rows that ran this
    loop (None: all); inactive and already exited rows keep their state and never fire.
    exit_now is true only on the loop a row first exits; `state.exited` accumulates it.
    """
    r = params.kind.shape[0]
    kind, thr = params.kind, params.threshold
    live = is_check(params, loop_idx) & ~state.exited
    if active is not None:
        live = live & active
    tokens = jnp.arange(latent.shape[0]) if row_of_token is None else row_of_token
    live_token = live[tokens]

    s = jnp.asarray(latent, jnp.float32)
    prev = state.prev_latent
    s_norm = jnp.linalg.norm(s, axis=-1)
    latent_diff = _row_mean(jnp.linalg.norm(s - prev, axis=-1) / s_norm, row_of_token, r, real_token)
    cos = jnp.sum(s * prev, axis=-1) / s_norm / jnp.linalg.norm(prev, axis=-1)
    cosine = 1.0 - _row_mean(cos, row_of_token, r, real_token)
    loops_run = jnp.asarray(loop_idx, jnp.float32) + 1.0

    fire = jnp.where(kind == LATENT_DIFF, latent_diff < thr,
                     jnp.where(kind == COSINE, cosine < thr,
                               (kind == STEPS) & (loops_run >= thr)))
    new = dict(prev_latent=jnp.where(live_token[:, None], s, prev))
    if logits is not None:
        logits = jnp.asarray(logits, jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)
        minp_log_probs = _minp_log_probs(probs)
        entropy = -jnp.sum(probs * jnp.log(probs + ENTROPY_EPS), axis=-1)
        argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        stable = jnp.where(argmax == state.prev_argmax, state.stable + 1, 0)
        kl = _kl(state.prev_log_probs, log_probs)
        minp_kl = _kl(state.prev_log_probs, minp_log_probs)
        fire = fire | jnp.select(
            [kind == KL, kind == MINP_KL, kind == ENTROPY_DIFF, kind == ARGMAX_STABILITY],
            [kl < thr, minp_kl < thr, jnp.abs(entropy - state.prev_entropy) < thr,
             stable.astype(jnp.float32) >= thr], False)
        next_log_probs = jnp.where((kind == MINP_KL)[:, None], minp_log_probs, log_probs)
        new.update(prev_log_probs=jnp.where(live[:, None], next_log_probs, state.prev_log_probs),
                   prev_entropy=jnp.where(live, entropy, state.prev_entropy),
                   prev_argmax=jnp.where(live, argmax, state.prev_argmax),
                   stable=jnp.where(live, stable, state.stable))
    exit_now = fire & live & (kind != NONE)
    return dataclasses.replace(state, exited=state.exited | exit_now, **new), exit_now
