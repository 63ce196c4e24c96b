"""Huginn-0125 / Raven: the HF checkpoint's tensor names and shapes, and their mapping onto
the loopjax params tree of docs/design.md (runtime code never sees HF names).

HF stores PyTorch `[out, in]` weights; loopjax stores `[in, out]`, so every matrix is
transposed here. Layer tensors: `transformer.{prelude,core_block,coda}.{i}.` +
  norm_{1..4}.weight [H]        -> norm_{1..4}
  attn.Wqkv.weight   [3H, H]    -> wqkv [H, 3H]     (rows [Q; K; V], head-major: kept as columns)
  attn.qk_bias       [2,1,Hq,D] -> qk_bias [2, Hq, D] (zeros when the config has no qk_bias)
  attn.proj.weight   [H, H]     -> wo [H, H]
  mlp.fc.weight      [2F, H]    -> w_gate_up [H, 2F] (gate rows first, then up)
  mlp.proj.weight    [H, F]     -> w_down [F, H]
Top level: transformer.wte.weight [V,H] -> embed; transformer.adapter.weight [H,2H] (input
concat[state, e], state first) -> its transpose's halves adapter_state = W[:, :H].T and
adapter_input = W[:, H:].T [H,H]; transformer.ln_f.weight -> ln_f.

`lm_head.weight` is optional: Huginn ties it to the embedding, and checkpoints may store the
duplicate; when present it must equal `transformer.wte.weight`. `freqs_cis` is a RoPE buffer
(RoPE is recomputed), accepted and ignored.
"""

from __future__ import annotations

import numpy as np

from loopjax.config import HuginnConfig

# Present in some checkpoints, never read: the persistent RoPE table (recomputed from rope_base).
# Entries are full-match patterns for the converter (a plain name matches itself).
IGNORED_HF_KEYS = frozenset({"freqs_cis"})

# May be present; checked by `to_params` (must equal the embedding) and otherwise dropped.
TIED_HF_KEY = "lm_head.weight"
EMBED_HF_KEY = "transformer.wte.weight"

_STACKS = (("prelude", "prelude", "num_prelude_layers"),
           ("core", "core_block", "num_core_layers"),
           ("coda", "coda", "num_coda_layers"))


def _layer_shapes(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {f"norm_{i}.weight": (h,) for i in range(1, 5)}
    shapes["attn.Wqkv.weight"] = (3 * h, h)
    if cfg.qk_bias:
        shapes["attn.qk_bias"] = (2, 1, cfg.num_heads, cfg.head_dim)
    shapes["attn.proj.weight"] = (h, h)
    shapes["mlp.fc.weight"] = (2 * f, h)
    shapes["mlp.proj.weight"] = (h, f)
    return shapes


def hf_tensor_shapes(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Huginn checkpoint must hold: HF name -> HF shape."""
    h = cfg.hidden_size
    shapes = {
        EMBED_HF_KEY: (cfg.vocab_size, h),
        "transformer.adapter.weight": (h, 2 * h),
        "transformer.ln_f.weight": (h,),
    }
    layer = _layer_shapes(cfg)
    for _, hf_stack, count in _STACKS:
        for i in range(getattr(cfg, count)):
            for name, shape in layer.items():
                shapes[f"transformer.{hf_stack}.{i}.{name}"] = shape
    return shapes


def optional_hf_tensor_shapes(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may hold beyond `hf_tensor_shapes` (checked when present).
    `IGNORED_HF_KEYS` are not listed: they are never read, whatever their shape."""
    return {TIED_HF_KEY: (cfg.vocab_size, cfg.hidden_size)}


def _matrix(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w).T)


def _layer_params(cfg: HuginnConfig, tensors, prefix: str) -> dict[str, np.ndarray]:
    get = lambda name: np.asarray(tensors[prefix + name])
    layer = {f"norm_{i}": get(f"norm_{i}.weight") for i in range(1, 5)}
    layer["wqkv"] = _matrix(get("attn.Wqkv.weight"))
    if cfg.qk_bias:
        layer["qk_bias"] = get("attn.qk_bias").reshape(2, cfg.num_heads, cfg.head_dim)
    else:
        layer["qk_bias"] = np.zeros((2, cfg.num_heads, cfg.head_dim), layer["wqkv"].dtype)
    layer["wo"] = _matrix(get("attn.proj.weight"))
    layer["w_gate_up"] = _matrix(get("mlp.fc.weight"))
    layer["w_down"] = _matrix(get("mlp.proj.weight"))
    return layer


def to_params(cfg: HuginnConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The loopjax Huginn params tree (numpy, the tensors' dtype) from HF-named tensors.

    Raises a one-line ValueError if a required tensor is missing or a stored `lm_head.weight`
    differs from the embedding (loopjax ties them, so an untied head would be silently lost).
    Callers check names and shapes against `hf_tensor_shapes` first.
    """
    missing = [name for name in hf_tensor_shapes(cfg) if name not in tensors]
    if missing:
        raise ValueError(f"huginn checkpoint lacks {len(missing)} tensor(s), first: {missing[0]}")
    embed = np.asarray(tensors[EMBED_HF_KEY])
    if TIED_HF_KEY in tensors and not np.array_equal(np.asarray(tensors[TIED_HF_KEY]), embed):
        raise ValueError(f"huginn checkpoint: {TIED_HF_KEY} differs from {EMBED_HF_KEY}, but "
                         "loopjax ties them (untied heads are not supported)")
    adapter = np.asarray(tensors["transformer.adapter.weight"])
    params = {
        "embed": embed,
        "adapter_state": _matrix(adapter[:, :cfg.hidden_size]),
        "adapter_input": _matrix(adapter[:, cfg.hidden_size:]),
        "ln_f": np.asarray(tensors["transformer.ln_f.weight"]),
    }
    for stack, hf_stack, count in _STACKS:
        params[stack] = [_layer_params(cfg, tensors, f"transformer.{hf_stack}.{i}.")
                         for i in range(getattr(cfg, count))]
    return params
