"""loopjax checkpoints: an Orbax pytree of params plus the loopjax config, in one folder.

Layout of a checkpoint folder:
    loopjax_config.json   `config.to_dict(cfg)`: the family (`model_type`) and every field
    params/               Orbax (StandardCheckpointer) save of the params pytree
plus, when written by the converter, the tokenizer / generation files and the original
Hugging Face config.json (model.py reads those; this module does not).

The params tree is whatever the family's `param_specs(cfg, dtype)` declares; `restore` asks
Orbax for exactly that tree (shapes checked against the stored metadata first, so a wrong
checkpoint fails with one line) and gets device arrays back, cast to `dtype` if asked. A
family may also declare an older layout (`legacy_param_specs`), which `restore` reads and
converts (`upgrade_legacy_params`): Huginn checkpoints with one [2H, H] "adapter".
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import config as config_lib

CONFIG_FILE = "loopjax_config.json"
PARAMS_DIR = "params"

# Accepted spellings of the two supported params dtypes.
DTYPE_NAMES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
               "f32": jnp.float32}


class CheckpointError(ValueError):
    """A folder that is not a (valid) loopjax checkpoint; the message is one line."""


def dtype_option(dtype: Any) -> Any:
    """None (the checkpoint's own dtype) for 'auto', HF's and vLLM's word for it; else as given."""
    return None if isinstance(dtype, str) and dtype.lower() == "auto" else dtype


def parse_dtype(dtype: Any) -> np.dtype:
    """bfloat16 or float32, from a name ('bf16', 'float32', ...) or a dtype; anything else is refused."""
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16, float32 or auto")
        return np.dtype(DTYPE_NAMES[dtype.lower()])
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16 or float32") from None
    if result not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):
        raise ValueError(f"unsupported dtype {result}; use bfloat16 or float32")
    return result


def model_module(cfg):
    """The family's model module (`loopjax.models.ouro` / `loopjax.models.huginn`)."""
    return importlib.import_module(f"loopjax.models.{cfg.family}")


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_config(path: str) -> config_lib.ModelConfig:
    """The loopjax config of the checkpoint at `path`."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no loopjax checkpoint at {path}: not a folder")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a loopjax checkpoint: it has no {CONFIG_FILE}")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise CheckpointError(f"{file} is not a valid loopjax config: not a JSON object")
        return config_lib.from_dict(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    except (TypeError, config_lib.ConfigError) as e:  # an unknown or missing field, a bad value
        raise CheckpointError(f"{file} is not a valid loopjax config: {e}") from None


def save(path: str, cfg: config_lib.ModelConfig, params) -> None:
    """Write `params` (numpy or jax arrays) and `cfg` to the folder `path` (created if missing;
    it must not already hold a checkpoint)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, PARAMS_DIR)) or is_checkpoint(path):
        raise CheckpointError(f"{path} already holds a checkpoint")
    os.makedirs(path, exist_ok=True)
    _check_tree(path, cfg, params, _leaf_dtype(params))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, PARAMS_DIR), params)
        checkpointer.wait_until_finished()
    # The config goes last: a folder without it is never mistaken for a checkpoint.
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config_lib.to_dict(cfg), f, indent=2)
        f.write("\n")


def stored_dtype(path: str) -> np.dtype:
    """The dtype the params were saved in."""
    leaves = jax.tree.leaves(_metadata_tree(path))
    return np.dtype(leaves[0].dtype)


def restore(path: str, dtype=None):
    """`(cfg, params)` from the checkpoint at `path`, params as device arrays on the default
    device, in `dtype` (default: the stored dtype)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    cfg = read_config(path)
    stored = _metadata_tree(path)
    arrays = len(jax.tree.leaves(stored))
    if cfg.num_distinct_layers > arrays:  # every layer has arrays; specs of 10**6 layers took minutes
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} declares {cfg.num_distinct_layers} "
                              f"layers, but the params hold {arrays} arrays in all")
    dtype = np.dtype(jax.tree.leaves(stored)[0].dtype) if dtype is None else parse_dtype(dtype)
    module = model_module(cfg)
    specs, upgrade = module.param_specs(cfg, dtype), None
    legacy = getattr(module, "legacy_param_specs", None)
    if legacy is not None and _keys(stored) == _keys(legacy(cfg, dtype)):  # an older layout
        specs, upgrade = legacy(cfg, dtype), module.upgrade_legacy_params
    _check_tree(path, cfg, stored, None, specs)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=device), specs)
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            with _orbax_task_errors_dropped():
                params = checkpointer.restore(os.path.join(path, PARAMS_DIR), target)
        except Exception as e:  # a truncated or missing data file: Orbax raises a bare Exception
            # whose message is a page of TensorStore spec; the root cause names the tensor
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            message = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            raise CheckpointError(f"cannot restore the params of {path}: {message}") from None
    return cfg, (upgrade(cfg, params) if upgrade else params)


def _keys(tree) -> set[str]:
    return {key for key, _ in _flatten(tree)}


def _metadata_tree(path: str):
    import orbax.checkpoint as ocp

    params_dir = os.path.join(path, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path} is not a loopjax checkpoint: it has no {PARAMS_DIR}/ folder")
    try:
        with ocp.StandardCheckpointer() as checkpointer, _absl_warnings_off():
            metadata = checkpointer.metadata(params_dir).item_metadata
        if metadata is None:  # Orbax logs a warning (off: the error says it) and returns None
            raise ValueError("its metadata is missing or unreadable")
        return metadata.tree
    except (ValueError, OSError, AttributeError) as e:
        raise CheckpointError(f"{params_dir} is not a readable Orbax checkpoint: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@contextlib.contextmanager
def _absl_warnings_off():
    """Orbax's warnings (absl's logger) off during the block: a missing metadata file was a
    WARNING line on stderr before the one-line error that says the same."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


class _OrbaxTaskErrors(logging.Filter):
    """Drops asyncio's records about Orbax's own tasks: a truncated data file fails several
    concurrent reads, and asyncio.run()'s shutdown logged each of the others (hundreds of
    lines of tracebacks and TensorStore specs, in some runs) before the one-line error that
    `restore` raises for the first."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "orbax" not in record.getMessage()


@contextlib.contextmanager
def _orbax_task_errors_dropped():
    """`_OrbaxTaskErrors` on asyncio's logger during the block (other records pass as ever)."""
    logger, dropped = logging.getLogger("asyncio"), _OrbaxTaskErrors()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def _leaf_dtype(params) -> np.dtype:
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise CheckpointError("params are empty")
    dtypes = {np.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) != 1:
        raise CheckpointError(f"params mix dtypes {sorted(map(str, dtypes))}; cast them to one dtype")
    return parse_dtype(dtypes.pop())


def _check_tree(path, cfg, tree, dtype, specs=None) -> None:
    """`tree` has the structure and shapes of `param_specs` (and `dtype`, unless None)."""
    specs = specs if specs is not None else model_module(cfg).param_specs(cfg, dtype)
    check_against_specs(tree, specs, f"params of {path}", check_dtype=dtype is not None)


def check_against_specs(tree, specs, what: str, check_dtype: bool = True) -> None:
    """One clear line for the first leaf of `tree` that differs from `specs` (or a structure
    difference); shared by save, restore and the converter."""
    got = dict(_flatten(tree))
    want = dict(_flatten(specs))
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing or extra:
        parts = ([f"missing {_few(missing)}"] if missing else []) + ([f"unexpected {_few(extra)}"]
                                                                      if extra else [])
        raise CheckpointError(f"{what} do not match the model's param_specs: " + "; ".join(parts))
    for key, spec in want.items():
        leaf = got[key]
        if tuple(leaf.shape) != tuple(spec.shape):
            raise CheckpointError(f"{what}: {key} has shape {tuple(leaf.shape)}, "
                                  f"param_specs expects {tuple(spec.shape)}")
        if check_dtype and np.dtype(leaf.dtype) != np.dtype(spec.dtype):
            raise CheckpointError(f"{what}: {key} has dtype {np.dtype(leaf.dtype)}, "
                                  f"param_specs expects {np.dtype(spec.dtype)}")


def _flatten(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p, simple=True, separator="."), leaf) for p, leaf in leaves]


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
