"""Helpers for the Ouro tests: golden data loading, an independent float64 NumPy reference
of the Ouro forward (for shapes the golden model does not cover, e.g. GQA), and the bf16
margin rule."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from loopjax.config import read_hf_config
from loopjax.convert.ouro_keys import to_params

DATA = Path(__file__).parent / "data" / "ouro"


def golden_config():
    return read_hf_config(str(DATA))


def golden_params(cfg, dtype, gate_bias: float | None = None):
    """Model A's params cast to dtype (round-to-nearest-even, as torch's .to(bfloat16));
    gate_bias overrides model.early_exit_gate.bias (Model A-sat: 8.0)."""
    params = to_params(cfg, load_file(str(DATA / "model.safetensors")))
    if gate_bias is not None:
        params["gate_b"] = np.asarray([gate_bias], np.float32)
    return jax.tree.map(lambda a: jnp.asarray(a).astype(dtype), params)


def load_npz(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name) as f:
        return dict(f)


def bf16_ulp(x):
    """The bf16 spacing at |x| (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


def margin_is_safe(logits_row, margin, dtype) -> bool:
    """The margin rule of the greedy checks: a top-1/top-2 margin is decisive when it exceeds
    two bf16 ulps at the top logit's magnitude (bf16 runs), or 1e-3 of that magnitude (fp32
    runs; the fp32 port agrees to ~1e-6)."""
    top = float(np.max(logits_row))
    bound = 2 * bf16_ulp(top) if dtype == jnp.bfloat16 else 1e-3 * abs(top)
    return float(margin) > bound


# ----------------------------------------------------- float64 NumPy reference (facts only)

def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    f = np.concatenate([pos[:, None] * inv] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(f) + rot * np.sin(f)


def numpy_reference(hf: dict[str, np.ndarray], cfg, ids, num_loops: int):
    """Per-loop normed hidden states [L, T, H] and gate logits [L, T] in float64, straight
    from HF-named tensors ([out, in] weights), written from the model facts."""
    w = {k: v.astype(np.float64) for k, v in hf.items()}
    n, nh, nkv, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = np.arange(n, dtype=np.float64)
    causal = np.tril(np.ones((n, n), bool))
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    hidden, gates = [], []
    for _ in range(num_loops):
        for i in range(cfg.num_layers):
            p = lambda name, i=i: w[f"model.layers.{i}.{name}.weight"]
            h = _rms(x, p("input_layernorm"), cfg.rms_norm_eps)
            q = _rope((h @ p("self_attn.q_proj").T).reshape(n, nh, d), pos, cfg.rope_theta)
            k = _rope((h @ p("self_attn.k_proj").T).reshape(n, nkv, d), pos, cfg.rope_theta)
            v = (h @ p("self_attn.v_proj").T).reshape(n, nkv, d)
            k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
            s = np.einsum("nhd,shd->hns", q, k) / np.sqrt(d)
            s = np.where(causal[None], s, -np.inf)
            prob = np.exp(s - s.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            a = np.einsum("hns,shd->nhd", prob, v).reshape(n, nh * d) @ p("self_attn.o_proj").T
            x = x + _rms(a, p("input_layernorm_2"), cfg.rms_norm_eps)
            h = _rms(x, p("post_attention_layernorm"), cfg.rms_norm_eps)
            g, u = h @ p("mlp.gate_proj").T, h @ p("mlp.up_proj").T
            m = (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj").T
            x = x + _rms(m, p("post_attention_layernorm_2"), cfg.rms_norm_eps)
        x = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps)
        hidden.append(x)
        gates.append(x @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
    return np.stack(hidden), np.stack(gates)
