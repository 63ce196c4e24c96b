"""Ouro (ByteDance looped LM): one stack of layers applied `loops` times, with an exit gate.

One definition used by every path: the identity `forward` below runs `embed`, `loop`,
`gate_logits` and `lm_head` with the cache-free `DenseCausal` backend; the engine runs the
same functions with its paged backend.

Conventions (docs/design.md): tokens packed on the first axis, `x [N, H]`; weights `[in, out]`;
activations in the params dtype; RoPE cos/sin computed once per position (positions do not
advance across loops). A loop is every layer once (a sandwich-norm block) and then the final
norm `model.norm`; its output is both the next loop's input and that loop's exit candidate.

Exit rules follow the reference exactly (tests/data/ouro/README.md §6): λ_i = sigmoid(gate_i),
p_i = λ_i·Π_{j<i}(1-λ_j), the last loop takes the rest, all in the model dtype; cdf = cumsum(p)
with torch's accumulation (fp32: the exact sum rounded to fp32 per output; bf16: fp32
accumulation rounded to bf16 per output); exit at the first loop with cdf >= threshold, else
the last. The batch form (`exit_pdf`, `exit_cdf`, `threshold_exit`) and the incremental form
(`ExitState`, `exit_init`, `exit_update`, for the engine's fused loop) share the same per-step
helpers, so they select the same loops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.config import OuroConfig
from loopjax.layers import (
    IDENTITY_COMPILER_OPTIONS,
    XLA_OPS,
    DenseCausal,
    QKVRope,
    linear,
    rope_angles,
    rotary_attention,
    silu_mul,
)

# Std of the normal the random (benchmark) weights are drawn from (HF's initializer_range).
INIT_STD = 0.02


# ----------------------------------------------------------------------------------- params

def param_specs(cfg: OuroConfig, dtype=jnp.bfloat16) -> dict:
    """The one declaration of the Ouro params tree (docs/design.md), as ShapeDtypeStructs."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    layer = lambda: {
        "attn_norm": spec(h), "attn_norm_2": spec(h), "mlp_norm": spec(h), "mlp_norm_2": spec(h),
        "wqkv": spec(h, q_dim + 2 * kv_dim), "wo": spec(q_dim, h),
        "w_gate_up": spec(h, 2 * f), "w_down": spec(f, h),
    }
    return {"embed": spec(v, h), "norm": spec(h), "gate_w": spec(h, 1), "gate_b": spec(1),
            "lm_head": spec(h, v), "layers": [layer() for _ in range(cfg.num_layers)]}


def init_params(cfg: OuroConfig, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Seeded random params of `param_specs(cfg, dtype)`, drawn on the default device leaf by
    leaf: norms 1, gate bias 0, every matrix N(0, INIT_STD)."""
    paths_specs, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg, dtype))
    keys = jax.random.split(key, len(paths_specs))
    leaves = []
    for (path, spec), k in zip(paths_specs, keys):
        name = path[-1].key
        if "norm" in name:
            leaves.append(jnp.ones(spec.shape, spec.dtype))
        elif name == "gate_b":
            leaves.append(jnp.zeros(spec.shape, spec.dtype))
        else:
            leaves.append(_normal_leaf(k, spec.shape, spec.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# NOTE: one small program per distinct (shape, dtype), a handful per model; a single program
# for the whole tree compiles far slower (tens of seconds at 1.4B).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal_leaf(key, shape, dtype):
    return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# ------------------------------------------------------------------------------------ model

def embed(params, ids):
    """ids [N] int -> x [N, H] (no scaling)."""
    return jnp.take(params["embed"], ids, axis=0)


# NOTE: kept for callers of the old private name; layers.silu_mul is the one definition.
_silu_mul = silu_mul


def _layer(lp, cfg: OuroConfig, x, x_normed, next_norm, cos, sin, attn, kv, layer_id: int, depth, ops,
           scratch):
    """One sandwich-norm decoder layer: x + norm_2(attn(norm(x))), then the same for the MLP.
    x_normed = rms_norm(x, attn_norm) comes in with x, and the layer hands on (x, rms_norm(x,
    next_norm)): each branch's closing norms and the next branch's input norm are one op
    (ops.linear_norm_add_norm), which a kernel runs in one pass. scratch: ops.mlp_scratch()'s,
    one for the loop's layers."""
    n, eps = x.shape[0], cfg.rms_norm_eps
    q_dim = cfg.num_heads * cfg.head_dim
    with jax.named_scope("attention"):
        rope = QKVRope(cos, sin, cfg.num_heads, cfg.num_kv_heads)
        kv, out = rotary_attention(attn, ops, kv, layer_id, depth, x_normed, lp["wqkv"], rope)
        x, x_normed = ops.linear_norm_add_norm(out.reshape(n, q_dim), lp["wo"], x,
                                               lp["attn_norm_2"], lp["mlp_norm"], eps)
    with jax.named_scope("mlp"):
        x, x_normed = ops.mlp_norm_add_norm(x_normed, lp["w_gate_up"], lp["w_down"], x,
                                            lp["mlp_norm_2"], next_norm, eps, scratch)
    return x, x_normed, kv


def loop(params, cfg: OuroConfig, x, cos, sin, attn, kv, depth, ops=XLA_OPS):
    """One loop: every layer once (unrolled; layer l uses cache layer l), then the final norm.
    x [N, H]; cos, sin [N, D/2] fp32 from `rope_angles`; depth = loop index (may be traced).
    Returns (h, kv): h is this loop's exit candidate and the next loop's input."""
    layers = params["layers"]
    next_norms = [lp["attn_norm"] for lp in layers[1:]] + [params["norm"]]
    x_normed = ops.rms_norm(x, layers[0]["attn_norm"], cfg.rms_norm_eps)
    scratch = ops.mlp_scratch()
    for layer_id, (lp, next_norm) in enumerate(zip(layers, next_norms)):
        with jax.named_scope(f"layer_{layer_id}"):
            x, x_normed, kv = _layer(lp, cfg, x, x_normed, next_norm, cos, sin, attn, kv,
                                     layer_id, depth, ops, scratch)
    return x_normed, kv  # the last layer's next norm is the final norm


def gate_logits(params, h):
    """Exit-gate logit [N] in the model dtype: h @ gate_w + gate_b with fp32 accumulation
    rounded once (torch's addmm folds the bias in before rounding)."""
    acc = jnp.dot(h, params["gate_w"], preferred_element_type=jnp.float32)[:, 0]
    return (acc + params["gate_b"].astype(jnp.float32)).astype(h.dtype)


def lm_head(params, h):
    """Logits [N, V] in the model dtype."""
    return linear(h, params["lm_head"])


# ------------------------------------------------------------------------------- exit rules

def _sigmoid(gate):
    """λ = sigmoid in fp32 rounded once to the gate's dtype (torch's reduced-precision sigmoid);
    jax.nn.sigmoid on bf16 would round after each of its exp/add/divide."""
    return jax.nn.sigmoid(gate.astype(jnp.float32)).astype(gate.dtype)


def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e == a + b exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _cdf_add(hi, lo, p):
    """Add p to the running cumsum (hi, lo), both f32.

    fp32 p: torch accumulates in float64 and rounds each output to fp32. Without x64 we keep
    the sum as an unevaluated pair hi + lo (hi = fl32(hi + lo), about 48 significant bits),
    so hi is the fp32 rounding of the running sum; it can differ from torch's double rounding
    only when the sum lies within ~2^-48 (relative) of an fp32 rounding midpoint.
    Reduced-precision p (bf16, f16): torch accumulates in fp32; lo stays 0."""
    p32 = p.astype(jnp.float32)
    if p.dtype != jnp.float32:
        return hi + p32, lo
    s, e = _two_sum(hi, p32)
    return _two_sum(s, lo + e)


def _cdf_value(hi, dtype):
    """The cdf output of torch.cumsum: the accumulator rounded to the model dtype."""
    return hi.astype(dtype)


def _exit_mass(lam, remaining, is_last):
    """One loop's (p_i, remaining after it), in the model dtype: p_i = λ_i·rem and
    rem·(1-λ_i), except the last loop, which takes the rest."""
    p = jnp.where(is_last, remaining, lam * remaining)
    return p, remaining * (jnp.asarray(1, lam.dtype) - lam)


def _reached(cdf, threshold):
    """cdf >= threshold, the threshold cast to the cdf's dtype as torch compares a tensor with
    a Python scalar."""
    return cdf >= jnp.asarray(threshold).astype(cdf.dtype)


def exit_pdf(gate):
    """gate [L, N] model-dtype logits -> p [L, N] in the model dtype."""
    num_loops = gate.shape[0]
    lam, remaining = _sigmoid(gate), jnp.ones(gate.shape[1:], gate.dtype)
    pdf = []
    for i in range(num_loops):
        p, remaining = _exit_mass(lam[i], remaining, i == num_loops - 1)
        pdf.append(p)
    return jnp.stack(pdf)


def exit_cdf(pdf):
    """torch.cumsum(pdf, loops) [L, N] in pdf's dtype, with torch's accumulation (_cdf_add)."""
    hi = lo = jnp.zeros(pdf.shape[1:], jnp.float32)
    cdf = []
    for p in pdf:
        hi, lo = _cdf_add(hi, lo, p)
        cdf.append(_cdf_value(hi, pdf.dtype))
    return jnp.stack(cdf)


def threshold_exit(cdf, threshold):
    """Exit loop [N] int32: the first loop whose cdf >= threshold, else the last loop."""
    reached = _reached(cdf, threshold)
    first = jnp.argmax(reached, axis=0).astype(jnp.int32)
    return jnp.where(reached.any(axis=0), first, cdf.shape[0] - 1).astype(jnp.int32)


def select_loop(loop_values, exit_loop):
    """loop_values [L, N, ...] -> [N, ...]: each token's value at its exit loop."""
    return jnp.take_along_axis(loop_values, exit_loop.reshape(1, -1, *[1] * (loop_values.ndim - 2)),
                               axis=0)[0]


def weighted_logits(loop_logits, pdf):
    """Σ_i p_i · logits_i, each product and partial sum rounded to the logits' dtype, in loop
    order (the reference's use_weighted_exit). loop_logits [L, N, V], pdf [L, N]."""
    total = None
    for logits, p in zip(loop_logits, pdf):
        term = logits * p.astype(logits.dtype)[:, None]
        total = term if total is None else total + term
    return total


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExitState:
    """Per-token exit state carried through a fused loop (`exit_init`, `exit_update`)."""

    remaining: jax.Array  # [N] model dtype: Π_{j<i}(1-λ_j), the mass no loop has taken yet
    cdf_hi: jax.Array     # [N] f32: running cumsum of p (see _cdf_add)
    cdf_lo: jax.Array     # [N] f32: its low part (fp32 models only; zero otherwise)
    exited: jax.Array     # [N] bool: a loop up to now reached the threshold (or was the last)
    exit_loop: jax.Array  # [N] int32: the loop selected (num_loops - 1 until exited)
    hidden: jax.Array     # [N, H] model dtype: hidden state of the selected loop


def exit_init(num_tokens: int, hidden_size: int, num_loops: int, dtype) -> ExitState:
    """The state before loop 0."""
    zeros = jnp.zeros((num_tokens,), jnp.float32)
    return ExitState(remaining=jnp.ones((num_tokens,), dtype), cdf_hi=zeros, cdf_lo=zeros,
                     exited=jnp.zeros((num_tokens,), bool),
                     exit_loop=jnp.full((num_tokens,), num_loops - 1, jnp.int32),
                     hidden=jnp.zeros((num_tokens, hidden_size), dtype))


def exit_update(state: ExitState, gate, hidden, depth, num_loops, threshold) -> ExitState:
    """Fold loop `depth` (may be traced) into the state: gate [N] model-dtype logits of this
    loop, hidden [N, H] its normed output; num_loops (int or per-token [N]) and threshold
    (scalar or [N]) may be traced. A token exits at the first loop whose cdf reaches
    `threshold` (or at its last loop); later loops leave its selection unchanged. After the
    last loop, `exit_loop` and `hidden` equal the batch rule's `threshold_exit` selection."""
    is_last = depth == num_loops - 1
    p, remaining = _exit_mass(_sigmoid(gate), state.remaining, is_last)
    hi, lo = _cdf_add(state.cdf_hi, state.cdf_lo, p)
    take = ~state.exited & (_reached(_cdf_value(hi, gate.dtype), threshold) | is_last)
    return ExitState(remaining=remaining, cdf_hi=hi, cdf_lo=lo, exited=state.exited | take,
                     exit_loop=jnp.where(take, jnp.asarray(depth, jnp.int32), state.exit_loop),
                     hidden=jnp.where(take[:, None], hidden, state.hidden))


# ---------------------------------------------------------------------------------- forward

@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OuroOutput:
    logits: jax.Array       # [T, V] f32, the exit-selected (or weighted) logits
    loop_logits: jax.Array  # [L, T, V] f32, lm_head of every loop's hidden state
    loop_hidden: jax.Array  # [L, T, H] model dtype, every loop's output after model.norm
    gate_logits: jax.Array  # [L, T] model dtype, exit-gate logits before the sigmoid
    exit_loop: jax.Array    # [T] int32, the loop selected (L - 1 for weighted exit)

    @property
    def exit_pdf(self) -> jax.Array:
        """[L, T] model dtype: the exit distribution p_i of the gates, as the reference computes
        it (the last loop takes the rest; its weights for the weighted exit)."""
        return exit_pdf(self.gate_logits)

    @property
    def exit_cdf(self) -> jax.Array:
        """[L, T] model dtype: its cumsum, which the threshold exit compares (torch's rounding)."""
        return exit_cdf(self.exit_pdf)




@functools.partial(jax.jit, static_argnums=(1, 3), compiler_options=IDENTITY_COMPILER_OPTIONS)
def _run_loops(params, cfg: OuroConfig, input_ids, num_loops: int):
    """Every loop's (hidden [L,T,H], gate [L,T], logits [L,T,V]) in the model dtype; loops run
    as a scan, the layers unrolled inside."""
    x = embed(params, input_ids)
    cos, sin = rope_angles(jnp.arange(input_ids.shape[0]), cfg.head_dim, cfg.rope_theta)
    attn = DenseCausal()

    def body(x, depth):
        h, _ = loop(params, cfg, x, cos, sin, attn, None, depth)
        return h, (h, gate_logits(params, h), lm_head(params, h))

    _, outs = jax.lax.scan(body, x, jnp.arange(num_loops))
    return outs


@functools.partial(jax.jit, compiler_options=IDENTITY_COMPILER_OPTIONS)
def _select_threshold(loop_logits, gate, threshold):
    exit_loop = threshold_exit(exit_cdf(exit_pdf(gate)), threshold)
    return select_loop(loop_logits, exit_loop), exit_loop


@functools.partial(jax.jit, compiler_options=IDENTITY_COMPILER_OPTIONS)
def _select_weighted(loop_logits, gate):
    return weighted_logits(loop_logits, exit_pdf(gate))


def forward(params, cfg: OuroConfig, input_ids, *, loops: int | None = None,
            exit_threshold: float | None = None, exit_step: int | None = None,
            weighted: bool = False) -> OuroOutput:
    """The identity path over one sequence input_ids [T] (positions 0..T-1).

    Selection, in order: `exit_step` (fixed loop) if given; else `weighted` (Σ p_i·logits_i);
    else the threshold rule with `exit_threshold`; else the config's `early_exit_step` where
    it is below `loops` (before its threshold, as the reference's `exit_at_step`); else the
    config's `early_exit_threshold`; else the last loop."""
    num_loops = cfg.total_ut_steps if loops is None else loops
    if not isinstance(num_loops, int) or num_loops < 1:
        raise ValueError(f"ouro forward: loops must be a positive integer, got {loops!r}")
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if input_ids.ndim != 1 or input_ids.shape[0] == 0:
        raise ValueError(f"ouro forward: input_ids must be a non-empty 1-D array, got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.shape[0] > cfg.max_position_embeddings:  # RoPE would run on, past what it was trained for
        raise ValueError(f"ouro forward: {input_ids.shape[0]} tokens exceed the context of "
                         f"{cfg.max_position_embeddings}")
    if exit_step is not None and weighted:
        raise ValueError("ouro forward: exit_step and weighted exit are exclusive")
    threshold = exit_threshold
    if exit_step is None and not weighted and threshold is None:  # the config's rule
        step, threshold = cfg.early_exit_step, cfg.early_exit_threshold
        if step is not None and step < num_loops:
            exit_step = step  # NOTE: the reference's exit_at_step comes before the threshold
        elif threshold is None:
            exit_step = num_loops - 1
    if exit_step is not None and not 0 <= exit_step < num_loops:
        raise ValueError(f"ouro forward: exit_step {exit_step} is outside 0..{num_loops - 1}")
    hidden, gate, loop_logits = _run_loops(params, cfg, input_ids, num_loops)
    num_tokens = input_ids.shape[0]
    if exit_step is not None:
        logits, exit_loop = loop_logits[exit_step], jnp.full((num_tokens,), exit_step, jnp.int32)
    elif weighted:
        logits = _select_weighted(loop_logits, gate)
        exit_loop = jnp.full((num_tokens,), num_loops - 1, jnp.int32)
    else:
        logits, exit_loop = _select_threshold(loop_logits, gate, jnp.float32(threshold))
    return OuroOutput(logits=logits.astype(jnp.float32), loop_logits=loop_logits.astype(jnp.float32),
                      loop_hidden=hidden, gate_logits=gate, exit_loop=exit_loop)


def greedy_nocache(params, cfg: OuroConfig, prompt, num_new: int, *,
                   padded_len: int | None = None) -> np.ndarray:
    """Greedy continuation by full recomputation (no cache), for tests: each step runs
    `forward` over prompt + generated tokens (default exit rule) and takes the argmax (first
    index on ties) at the last real position. The sequence is right-padded to `padded_len`
    (default: the next power of two) so every step reuses one compiled forward; causal
    attention keeps the padding out of the real positions."""
    prompt = np.asarray(prompt, np.int32)
    total_len = prompt.shape[0] + num_new
    padded_len = padded_len or max(16, 1 << (total_len - 1).bit_length())
    if padded_len < total_len:
        raise ValueError(f"greedy_nocache: padded_len {padded_len} < prompt + new tokens {total_len}")
    ids = np.zeros(padded_len, np.int32)
    ids[:prompt.shape[0]] = prompt
    for i in range(num_new):
        pos = prompt.shape[0] + i
        logits = forward(params, cfg, ids).logits
        ids[pos] = int(jnp.argmax(logits[pos - 1]))
    return ids[prompt.shape[0]:total_len].copy()
