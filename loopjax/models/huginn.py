"""Huginn-0125 / Raven (recurrent-depth LM): one definition used by every path.

    e   = prelude(embed(ids))                       embed = wte(ids) * sqrt(H)
    s_0 = initial state per position                 (random, zero, or given)
    s_i = core(adapter(concat[s_{i-1}, e]))           i = 1..loops (state first)
          adapter(concat[s, e]) = s @ adapter_state + e @ adapter_input, e's part once per token
    logits = lm_head(ln_f(coda(ln_f(s_loops))))       tied lm_head = embed.T

Every layer is a sandwich block: x = norm_2(x + attn(norm_1 x)); x = norm_4(x + mlp(norm_3 x));
a layer's norm_1 runs with the previous layer's norm_4 as one op (`_stack`).
Attention: fused Wqkv (columns [q | k | v], head-major), qk_bias added to q and k before RoPE,
interleaved-pair RoPE in fp32, no GQA. The model calls the attention backend through
`layers.rotary_attention` (as `attn(kv, layer_id, depth, q, k, v)`, or with the projection's
qkv where the backend rotates in its K/V write) with cache-layer ids prelude i -> i, core j -> P + j,
coda i -> P + R + i; `depth` is the loop index for core layers and 0 elsewhere.

Shapes: tokens packed on the first axis (`x [N, H]`); cos, sin [N, D/2] fp32 from
`layers.rope_angles(positions, D, rope_base)`. Activations are in the params dtype; `coda`
returns logits in that dtype (the reference's lm_head), `forward` returns them as float32.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.config import HuginnConfig
from loopjax.layers import (
    IDENTITY_COMPILER_OPTIONS,
    XLA_OPS,
    DenseCausal,
    QKVRope,
    rms_norm,
    rope_angles,
    rotary_attention,
)

# ---------------------------------------------------------------- params

_NORMS = ("norm_1", "norm_2", "norm_3", "norm_4")


def _layer_specs(cfg: HuginnConfig, dtype):
    h, f = cfg.hidden_size, cfg.intermediate_size
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    layer = {name: spec(h) for name in _NORMS}
    layer.update(wqkv=spec(h, 3 * h), qk_bias=spec(2, cfg.num_heads, cfg.head_dim), wo=spec(h, h),
                 w_gate_up=spec(h, 2 * f), w_down=spec(f, h))
    return layer


def param_specs(cfg: HuginnConfig, dtype=jnp.float32):
    """The one declaration of the Huginn params tree (docs/design.md), as ShapeDtypeStructs."""
    h = cfg.hidden_size
    return {
        "embed": jax.ShapeDtypeStruct((cfg.vocab_size, h), dtype),
        # the adapter [2H, H] of concat[s, e] in its two halves: separate buffers, so that e's
        # (the same every loop) is taken once per token (`inject`) without slicing a weight
        "adapter_state": jax.ShapeDtypeStruct((h, h), dtype),
        "adapter_input": jax.ShapeDtypeStruct((h, h), dtype),
        "ln_f": jax.ShapeDtypeStruct((h,), dtype),
        "prelude": [_layer_specs(cfg, dtype) for _ in range(cfg.num_prelude_layers)],
        "core": [_layer_specs(cfg, dtype) for _ in range(cfg.num_core_layers)],
        "coda": [_layer_specs(cfg, dtype) for _ in range(cfg.num_coda_layers)],
    }


def legacy_param_specs(cfg: HuginnConfig, dtype=jnp.float32):
    """The params tree of checkpoints written before the adapter was stored in two halves
    (one "adapter" [2H, H]); loopjax.checkpoint restores it through `upgrade_legacy_params`."""
    specs = param_specs(cfg, dtype)
    del specs["adapter_state"], specs["adapter_input"]
    return {**specs, "adapter": jax.ShapeDtypeStruct((2 * cfg.hidden_size, cfg.hidden_size), dtype)}


def upgrade_legacy_params(cfg: HuginnConfig, params):
    """A `legacy_param_specs` tree in today's layout: the adapter's halves as separate buffers."""
    params = dict(params)
    adapter, h = params.pop("adapter"), cfg.hidden_size
    return {**params, "adapter_state": adapter[:h], "adapter_input": adapter[h:]}


@partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal_leaf(key, std, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def init_params(cfg: HuginnConfig, key, dtype=jnp.bfloat16):
    """Seeded random params of `param_specs` (for benchmarks at the real sizes), made on device
    leaf by leaf. Scales follow the reference's "takase" init: std sqrt(2/(5H)) for inputs,
    divided by sqrt(2 * effective depth) for the output projections; norm gains are ones."""
    std = cfg.init_state_std
    depth = cfg.num_prelude_layers + cfg.num_coda_layers + cfg.num_core_layers * cfg.mean_recurrence
    out_std = std / math.sqrt(2 * depth)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg, dtype))
    params = []
    for index, (path, spec) in enumerate(leaves):
        name = path[-1].key
        if name in _NORMS or name == "ln_f":
            params.append(jnp.ones(spec.shape, spec.dtype))
        else:
            scale = out_std if name in ("wo", "w_down") else std
            params.append(_normal_leaf(jax.random.fold_in(key, index), scale, spec.shape,
                                       jnp.dtype(spec.dtype)))
    return jax.tree_util.tree_unflatten(treedef, params)


# ---------------------------------------------------------------- blocks

def _block(layer, cfg: HuginnConfig, x, x_normed, next_norm, cos, sin, attn, kv, layer_id: int, depth, ops):
    """Sandwich block: x = norm_2(x + attn(norm_1 x)); x = norm_4(x + mlp(norm_3 x)).
    x_normed = norm_1(x) comes in with x, and the block hands on (x, next_norm(x)), or
    (x, None) without a next norm: each branch's closing norm and the next branch's input norm
    are one op (ops.linear_add_norm_norm), which a kernel runs in one pass."""
    n, eps = x.shape[0], cfg.norm_eps
    # NOTE: the bias goes on before RoPE (the reference adds it to the projected q, k).
    rope = QKVRope(cos, sin, cfg.num_heads, cfg.num_heads, layer["qk_bias"])
    kv, out = rotary_attention(attn, ops, kv, layer_id, depth, x_normed, layer["wqkv"], rope)
    x, x_normed = ops.linear_add_norm_norm(out.reshape(n, cfg.hidden_size), layer["wo"], x,
                                           layer["norm_2"], layer["norm_3"], eps)
    act = ops.linear_silu_mul(x_normed, layer["w_gate_up"])  # w_gate_up's columns: [gate | up]
    if next_norm is None:
        return ops.add_rms_norm(ops.linear(act, layer["w_down"]), x, layer["norm_4"], eps), None, kv
    x, x_normed = ops.linear_add_norm_norm(act, layer["w_down"], x, layer["norm_4"], next_norm, eps)
    return x, x_normed, kv


def _stack(layers, cfg: HuginnConfig, x, cos, sin, attn, kv, first_id: int, depth, ops, final_norm=None):
    """The layers in turn (cache layers first_id, first_id + 1, ...) -> (x, final_norm(x) or
    None, kv): each layer's input norm runs with the previous layer's closing norms."""
    x_normed = ops.rms_norm(x, layers[0]["norm_1"], cfg.norm_eps)
    next_norms = [layer["norm_1"] for layer in layers[1:]] + [final_norm]
    for i, (layer, next_norm) in enumerate(zip(layers, next_norms, strict=True)):
        x, x_normed, kv = _block(layer, cfg, x, x_normed, next_norm, cos, sin, attn, kv, first_id + i,
                                 depth, ops)
    return x, x_normed, kv


def embed(params, cfg: HuginnConfig, ids):
    """wte(ids) * sqrt(H) [N, H]; the product is taken in fp32 and rounded once to the params
    dtype (torch multiplies a tensor by a Python float in fp32 opmath)."""
    x = jnp.take(params["embed"], ids, axis=0)
    return (x.astype(jnp.float32) * cfg.embed_scale).astype(x.dtype)


def prelude(params, cfg: HuginnConfig, x, cos, sin, attn, kv, ops=XLA_OPS):
    """The prelude layers on the embedded tokens: returns e, the input injected every loop."""
    with jax.named_scope("huginn_prelude"):
        e, _, kv = _stack(params["prelude"], cfg, x, cos, sin, attn, kv, 0, 0, ops)
    return e, kv


def inject(params, e):
    """e @ adapter_input f32 [N, H]: the injected input's part of the adapter's product, the
    same in every loop (core_loop continues the fp32 sum with s's part and rounds once)."""
    return jnp.dot(e, params["adapter_input"], preferred_element_type=jnp.float32)


def core_loop(params, cfg: HuginnConfig, s, injected, cos, sin, attn, kv, depth, ops=XLA_OPS):
    """One recurrence: s' = core(adapter(concat[s, e])), with injected = inject(params, e).
    `depth` is the loop index (0-based)."""
    with jax.named_scope("huginn_core"):
        x = ops.linear_accumulate(s, params["adapter_state"], injected)
        x, _, kv = _stack(params["core"], cfg, x, cos, sin, attn, kv, cfg.num_prelude_layers, depth, ops)
    return x, kv


def lm_head(params, x):
    """Tied head: x @ embed.T [N, V] in the params dtype (contracting embed's H axis directly)."""
    return jnp.einsum("nh,vh->nv", x, params["embed"],
                      preferred_element_type=jnp.float32).astype(x.dtype)


def coda(params, cfg: HuginnConfig, s, cos, sin, attn, kv, ops=XLA_OPS, logit_rows=None):
    """ln_f, the coda layers, ln_f again, tied lm_head: logits [N, V] in the params dtype, or
    only the tokens at `logit_rows` ([R] indices: [R, V]). The coda layers run over every
    token either way (later tokens read their KV); the head is the step's largest product."""
    with jax.named_scope("huginn_coda"):
        x = ops.rms_norm(s, params["ln_f"], cfg.norm_eps)
        first_id = cfg.num_prelude_layers + cfg.num_core_layers
        _, x, kv = _stack(params["coda"], cfg, x, cos, sin, attn, kv, first_id, 0, ops,
                          final_norm=params["ln_f"])
        return lm_head(params, x if logit_rows is None else x[logit_rows]), kv


# ---------------------------------------------------------------- initial state

def initial_state(cfg: HuginnConfig, seed, positions, dtype=jnp.float32):
    """Random s_0 [N, H], a pure function of (seed, position): row n depends only on
    (seed[n] or seed, positions[n]), so a position gets the same state whatever the batch,
    chunking or prefix cache. Distribution as the reference's: a normal truncated at ±3σ with
    σ = sqrt(2/(5H)), times sqrt(H). `seed` is an int or an int array broadcast to positions."""
    positions = jnp.asarray(positions, jnp.int32)
    seeds = jnp.broadcast_to(jnp.asarray(seed, jnp.uint32), positions.shape)
    return _position_noise(seeds, positions, cfg.hidden_size, cfg.init_state_std, jnp.dtype(dtype))


@partial(jax.jit, static_argnames=("hidden_size", "std", "dtype"))
def _position_noise(seeds, positions, hidden_size, std, dtype):
    def one(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.truncated_normal(key, -3.0, 3.0, (hidden_size,), jnp.float32)

    z = jax.vmap(one)(seeds, positions)
    return (z * std * math.sqrt(hidden_size)).astype(dtype)


def zero_state(cfg: HuginnConfig, num_tokens: int, dtype=jnp.float32):
    """s_0 = 0 (the reference's init_scale=0)."""
    return jnp.zeros((num_tokens, cfg.hidden_size), dtype)


# ---------------------------------------------------------------- identity path

@partial(jax.tree_util.register_dataclass,
         data_fields=["logits", "loop_logits", "loop_hidden", "latents"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HuginnOutput:
    logits: jax.Array       # [T, V] f32, after the last loop
    loop_logits: jax.Array | None  # [L, T, V] f32, coda + lm_head of every loop's state (or None)
    loop_hidden: jax.Array  # [L, T, H] params dtype, the raw states s_1..s_L
    latents: jax.Array      # [T, H] params dtype, ln_f(s_L) (the coda input)


@partial(jax.jit, static_argnames=("cfg", "loops", "per_loop_logits"),
         compiler_options=IDENTITY_COMPILER_OPTIONS)  # as every model path: semantics.md, bf16 identity
def _forward(params, cfg: HuginnConfig, input_ids, s0, loops: int, per_loop_logits: bool = True):
    attn = DenseCausal()
    t = input_ids.shape[0]
    cos, sin = rope_angles(jnp.arange(t), cfg.head_dim, cfg.rope_base)
    e, _ = prelude(params, cfg, embed(params, cfg, input_ids), cos, sin, attn, None)
    injected = inject(params, e)

    def one_loop(s, depth):
        s, _ = core_loop(params, cfg, s, injected, cos, sin, attn, None, depth)
        if not per_loop_logits:
            return s, (s, None)
        logits, _ = coda(params, cfg, s, cos, sin, attn, None)
        return s, (s, logits.astype(jnp.float32))

    s, (loop_hidden, loop_logits) = jax.lax.scan(one_loop, s0, jnp.arange(loops))
    if loops and per_loop_logits:
        logits = loop_logits[-1]
    else:
        logits = coda(params, cfg, s, cos, sin, attn, None)[0].astype(jnp.float32)
    return HuginnOutput(logits=logits, loop_logits=loop_logits, loop_hidden=loop_hidden,
                        latents=rms_norm(s, params["ln_f"], cfg.norm_eps))


def forward(params, cfg: HuginnConfig, input_ids, *, loops: int | None = None,
            initial_state=None, seed: int = 0, per_loop_logits: bool = True) -> HuginnOutput:
    """The identity path for one sequence `input_ids [T]` at positions 0..T-1 (DenseCausal).

    loops: None -> cfg.mean_recurrence; 0 sends s_0 straight to ln_f and the coda.
    initial_state: an array [T, H] (explicit s_0), "zero", or None -> the position-keyed
    random state `initial_state(cfg, seed, arange(T))`. per_loop_logits=False runs the coda
    and head once, after the last loop (loop_logits is None): scoring at 32 loops would
    otherwise hold [32, T, V] f32 logits (17 GB at 2,048 tokens of Huginn-0125).
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 1 or input_ids.shape[0] == 0:
        raise ValueError(f"huginn forward: input_ids must be a non-empty 1-D array, got shape "
                         f"{input_ids.shape}")
    t = input_ids.shape[0]
    if t > cfg.max_position_embeddings:
        raise ValueError(f"huginn forward: {t} tokens exceed the context of "
                         f"{cfg.max_position_embeddings}")
    loops = cfg.mean_recurrence if loops is None else loops
    if isinstance(loops, bool) or not isinstance(loops, int | np.integer) or loops < 0:
        raise ValueError(f"huginn forward: loops must be a non-negative int, got {loops!r}")
    s0 = resolve_initial_state(cfg, initial_state, t, seed, params["embed"].dtype)
    return _forward(params, cfg, input_ids, s0, int(loops), per_loop_logits)


def resolve_initial_state(cfg: HuginnConfig, spec, num_tokens: int, seed, dtype):
    """s_0 [num_tokens, H] from forward's `initial_state` argument (array, "zero", or "seeded" /
    None: the seeded default, as `score` and the engine name it)."""
    if spec is None or (isinstance(spec, str) and spec == "seeded"):
        return initial_state(cfg, seed, jnp.arange(num_tokens), dtype)
    if isinstance(spec, str):
        if spec != "zero":
            raise ValueError(f"huginn initial_state: unknown mode {spec!r}; use an array, "
                             "'zero' or 'seeded' (None: seeded)")
        return zero_state(cfg, num_tokens, dtype)
    try:
        s0 = jnp.asarray(spec, dtype)
    except (TypeError, ValueError):  # NOTE: numpy's words ("could not convert string") name no field
        raise ValueError(f"huginn initial_state: expected an array [{num_tokens}, {cfg.hidden_size}] of "
                         f"numbers, got {type(spec).__name__}") from None
    if s0.shape != (num_tokens, cfg.hidden_size):
        raise ValueError(f"huginn initial_state: expected shape {(num_tokens, cfg.hidden_size)}, "
                         f"got {s0.shape}")
    return s0


def generate_greedy_recompute(params, cfg: HuginnConfig, prompt_ids, max_new_tokens: int, *,
                              initial_states=None, warm_start: bool = False,
                              loops: int | None = None, seed: int = 0):
    """Greedy decoding by recomputing the whole sequence at every step (no cache): the test
    oracle for cached decoding. Returns (tokens [max_new_tokens] int32, logits
    [max_new_tokens, V] f32 of the last position of each step, s_0 used [T + max_new - 1, H]).

    Every step runs one fixed-length buffer of T + max_new_tokens - 1 positions (one compile);
    positions past the current length hold pad tokens, which causal attention never lets
    earlier positions see. initial_states: per-position s_0 (an array with a row for every
    processed position, like the goldens' `gen_init_states`; only the prompt's rows when
    warm_start), "zero", or None (position-keyed random from `seed`).
    warm_start: a decoded position's s_0 is ln_f of the previous position's final state
    ("continuous compute", the goldens' `gen_cc_*`); prompt positions keep their states.
    """
    prompt_ids = np.asarray(prompt_ids)
    num_prompt = prompt_ids.shape[0]
    if max_new_tokens < 1:
        raise ValueError(f"huginn generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    total = num_prompt + max_new_tokens - 1
    loops = cfg.mean_recurrence if loops is None else loops
    dtype = params["embed"].dtype
    if initial_states is None or isinstance(initial_states, str):
        s0 = resolve_initial_state(cfg, initial_states, total, seed, dtype)
    else:
        s0 = jnp.asarray(initial_states, dtype)
        needed = num_prompt if warm_start else total
        if s0.ndim != 2 or s0.shape[0] < needed or s0.shape[1] != cfg.hidden_size:
            raise ValueError(f"huginn generate: initial_states needs shape [>= {needed}, "
                             f"{cfg.hidden_size}], got {s0.shape}")
        s0 = jnp.zeros((total, cfg.hidden_size), dtype).at[:min(total, s0.shape[0])].set(s0[:total])
    ids = jnp.zeros((total,), jnp.int32).at[:num_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    tokens, step_logits = [], []
    for step in range(max_new_tokens):
        last = num_prompt + step - 1
        out = _forward(params, cfg, ids, s0, int(loops))
        token = jnp.argmax(out.logits[last]).astype(jnp.int32)
        tokens.append(token)
        step_logits.append(out.logits[last])
        if step + 1 < max_new_tokens:
            ids = ids.at[last + 1].set(token)
            if warm_start:
                s0 = s0.at[last + 1].set(out.latents[last])
    return jnp.stack(tokens), jnp.stack(step_logits), s0
