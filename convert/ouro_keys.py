"""Ouro: the Hugging Face checkpoint's tensor names and shapes, and their mapping onto the
loopjax params tree (docs/design.md, "Params pytrees").

HF stores Linear weights `[out, in]`; loopjax stores `[in, out]`. q|k|v are fused into
`wqkv` (columns [q | k | v], each head-major as HF's `view(T, heads, head_dim)` reads them)
and gate|up into `w_gate_up` (columns [gate | up]). Names and shapes are checked by the
converter against `hf_tensor_shapes` before `to_params` runs, so `to_params` trusts them.
"""

from __future__ import annotations

import re

import numpy as np

from loopjax.config import OuroConfig

# Tensors a checkpoint may carry that loopjax recomputes or does not use (full-match regexes).
IGNORED_HF_KEYS: tuple[str, ...] = (
    r"model\.rotary_emb\.inv_freq",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
)
_IGNORED = tuple(re.compile(p) for p in IGNORED_HF_KEYS)

EMBED_HF_KEY = "model.embed_tokens.weight"
LM_HEAD_HF_KEY = "lm_head.weight"  # required when untied; optional (a duplicate) when tied


def is_ignored(name: str) -> bool:
    """True for a tensor name that may be present in a checkpoint but is not loaded."""
    return any(p.fullmatch(name) for p in _IGNORED)


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def hf_tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Ouro checkpoint must hold: name -> PyTorch shape ([out, in] for
    Linear weights). `lm_head.weight` is not required when the embeddings are tied."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        EMBED_HF_KEY: (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD_HF_KEY] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = _layer_prefix(i)
        shapes.update({
            p + "self_attn.q_proj.weight": (q_dim, h),
            p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h),
            p + "self_attn.o_proj.weight": (h, q_dim),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm_2.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm_2.weight": (h,),
        })
    return shapes


def optional_hf_tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may hold beyond `hf_tensor_shapes`: with tied embeddings, the
    duplicate `lm_head.weight` that some exporters store next to the embedding (HF's loader
    accepts it); `to_params` requires it to equal the embedding."""
    return {LM_HEAD_HF_KEY: (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}


# loopjax layer-norm field -> HF module name (docs/design.md).
_LAYER_NORMS = {
    "attn_norm": "input_layernorm",
    "attn_norm_2": "input_layernorm_2",
    "mlp_norm": "post_attention_layernorm",
    "mlp_norm_2": "post_attention_layernorm_2",
}


def to_params(cfg: OuroConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The loopjax Ouro params tree (numpy arrays, the checkpoint's dtype) from HF tensors.
    Assumes names and shapes were checked against `hf_tensor_shapes(cfg)`. With tied
    embeddings a stored `lm_head.weight` must equal the embedding (one-line ValueError
    otherwise): the head is not loaded, so a different one would be silently lost."""
    t = {name: np.asarray(value) for name, value in tensors.items()}
    embed = t[EMBED_HF_KEY]
    if cfg.tie_word_embeddings and LM_HEAD_HF_KEY in t and not np.array_equal(t[LM_HEAD_HF_KEY], embed):
        raise ValueError(f"ouro checkpoint: {LM_HEAD_HF_KEY} differs from {EMBED_HF_KEY}, but "
                         "config.json sets tie_word_embeddings")
    lm_head = embed if cfg.tie_word_embeddings else t[LM_HEAD_HF_KEY]
    layers = []
    for i in range(cfg.num_layers):
        p = _layer_prefix(i)
        layer = {ours: t[p + theirs + ".weight"] for ours, theirs in _LAYER_NORMS.items()}
        qkv = [t[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
        layer["wqkv"] = np.ascontiguousarray(np.concatenate(qkv, axis=0).T)
        layer["wo"] = np.ascontiguousarray(t[p + "self_attn.o_proj.weight"].T)
        gate_up = [t[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
        layer["w_gate_up"] = np.ascontiguousarray(np.concatenate(gate_up, axis=0).T)
        layer["w_down"] = np.ascontiguousarray(t[p + "mlp.down_proj.weight"].T)
        layers.append(layer)
    return {
        "embed": embed,
        "norm": t["model.norm.weight"],
        "gate_w": np.ascontiguousarray(t["model.early_exit_gate.weight"].T),
        "gate_b": t["model.early_exit_gate.bias"],
        "lm_head": np.ascontiguousarray(lm_head.T),
        "layers": layers,
    }
