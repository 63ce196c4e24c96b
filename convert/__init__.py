"""Hugging Face → loopjax checkpoint conversion.

`convert(hf_dir, out_dir, dtype)` writes a loopjax checkpoint; `load_hf(hf_dir, dtype)` gives
`(cfg, numpy params)` in memory. Per-family HF name tables live in `<family>_keys.py`
(`hf_tensor_shapes`, `IGNORED_HF_KEYS`, `to_params`). Names are exported lazily so that the
CLI's argument parsing does not import JAX.
"""

import importlib

_EXPORTS = {"convert": "converter", "load_hf": "converter", "ConvertError": "converter"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"loopjax.convert.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'loopjax.convert' has no attribute {name!r}")
