"""The user-facing model: `load` a converted checkpoint, an HF folder or a preset, and run
the identity-path `forward` of its family.

`Model` bundles what every entry point needs: the family config, the params pytree (device
arrays, one dtype), the tokenizer and the generation defaults found next to the weights.
`forward` checks its arguments once, here, and dispatches to `loopjax.models.<family>.forward`
(pure functions; the engine never goes through this module's dispatch).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from loopjax import checkpoint, hub_cache, tokenizer_files
from loopjax import config as config_lib
from loopjax.request import holds_bools


class LoadError(ValueError):
    """A model that cannot be loaded; the message is one line naming the path or preset."""


@dataclass(frozen=True, eq=False)  # eq=False: identity equality/hash (params are not hashable)
class Model:
    cfg: config_lib.ModelConfig
    params: Any  # the family's params pytree (docs/design.md), device arrays of one dtype
    tokenizer: Any = None  # tokenizers.Tokenizer, or None when the folder has no tokenizer.json
    path: str | None = None  # the folder it was loaded from; None for a preset
    generation_config: dict | None = None  # generation_config.json; None: there is none
    chat_template: str | None = None  # Jinja chat template of the tokenizer, if any

    @functools.cached_property
    def special_tokens(self) -> dict:
        """The folder's named special tokens (`tokenizer_files.special_tokens_map`), read once per
        model: every chat request's template variables (`chat.special_tokens`)."""
        return tokenizer_files.special_tokens_map(self.path)

    @property
    def family(self) -> str:
        return self.cfg.family

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(jax.tree.leaves(self.params)[0].dtype)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` with the tokenizer's own special tokens (a BOS where its
        post-processor adds one), as HF's `tokenizer(text)` and vLLM's text prompts; text a chat
        template rendered passes add_special_tokens=False (the template writes its own)."""
        return self._require_tokenizer().encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._require_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            where = f"no tokenizer.json in {self.path}" if self.path else "a preset has no tokenizer"
            raise ValueError(f"this model has no tokenizer ({where}); pass token ids instead")
        return self.tokenizer


def load(path_or_preset: str, dtype=None) -> Model:
    """A `Model` from a loopjax checkpoint folder (has loopjax_config.json), a Hugging Face
    folder (config.json + safetensors; converted in memory, nothing written), a preset name
    of `config.PRESETS` (seeded random weights), or a Hub name ('org/name') whose snapshot is
    in the local Hugging Face cache (`hub_cache`; nothing is downloaded).

    dtype: 'bfloat16' / 'float32' (or the dtypes). Default (None or 'auto'): the checkpoint's
    dtype; for presets bf16 at the real sizes and fp32 for the `*-tiny` ones."""
    path = os.path.expanduser(os.fspath(path_or_preset))  # '~/model' is the home folder's
    dtype = checkpoint.dtype_option(dtype)
    if os.path.isdir(path):
        return _load_folder(path, dtype)
    if os.path.exists(path):
        raise LoadError(f"cannot load {path}: it is a file, not a model folder")
    if path in config_lib.PRESETS:
        return _load_preset(path, dtype)
    if (cached := hub_cache.snapshot(path)) is not None:  # a Hub name already downloaded
        return _load_folder(cached, dtype)
    raise LoadError(f"no model at {path!r}: not a folder and not a preset (presets: "
                    + ", ".join(sorted(config_lib.PRESETS)) + ")" + hub_cache.missing_hint(path))


def _load_folder(path: str, dtype) -> Model:
    if checkpoint.is_checkpoint(path):
        cfg, params = checkpoint.restore(path, dtype)
    elif hub_cache.is_file(os.path.join(path, "config.json")):
        from loopjax.convert.converter import load_hf

        cfg, params = load_hf(path, dtype)
        params = jax.device_put(params)
    else:
        raise LoadError(f"{path} is neither a loopjax checkpoint ({checkpoint.CONFIG_FILE}) nor a "
                        "Hugging Face model folder (config.json)")
    return Model(cfg=cfg, params=params, tokenizer=_read_tokenizer(path), path=path,
                 generation_config=_read_json(path, "generation_config.json"),
                 chat_template=_read_chat_template(path))


def _load_preset(name: str, dtype) -> Model:
    cfg = config_lib.preset(name)
    if dtype is None:
        dtype = "float32" if name.endswith("-tiny") else "bfloat16"
    dtype = checkpoint.parse_dtype(dtype)
    params = checkpoint.model_module(cfg).init_params(cfg, jax.random.key(0), dtype)
    return Model(cfg=cfg, params=params)


def _read_json(folder: str, name: str) -> dict | None:
    file = os.path.join(folder, name)
    if not hub_cache.is_file(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:  # as transformers reads it, whatever the locale
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise LoadError(f"{file} is not a JSON object")
    return data


def _read_tokenizer(folder: str):
    file = os.path.join(folder, "tokenizer.json")
    if not hub_cache.is_file(file):
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for unreadable files
        reason = str(e).splitlines()[0] if str(e) else repr(e)  # NOTE: `{a if c else e!r}` is repr(a)
        raise LoadError(f"cannot read {file}: {reason}") from None
    tokenizer_files.apply_add_special_tokens(tokenizer, folder)  # tokenizer_config.json's add_bos_token
    return tokenizer


def _read_chat_template(folder: str) -> str | None:
    """`chat_template.jinja` if present (newer HF layout), else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: 'default' or the first)."""
    jinja = os.path.join(folder, "chat_template.jinja")
    if hub_cache.is_file(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:  # as transformers reads it
                return f.read()
        except UnicodeDecodeError as e:
            raise LoadError(f"{jinja} is not UTF-8 text: {e}") from None
    template = (_read_json(folder, "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def forward(model: Model, input_ids, *, loops: int | None = None, initial_state=None,
            exit_threshold: float | None = None, exit_step: int | None = None,
            exit_weighted: bool = False):
    """The identity path of `model` on one sequence `input_ids [T]` (positions 0..T-1).

    loops: loop count (default: the config's). Ouro's exit rule, as the reference's forward
    arguments (SamplingParams' names; one of them): exit_threshold, the cumulative
    exit-probability threshold (default: the config's); exit_step, loop k's logits (0-based,
    the reference's exit_at_step); exit_weighted, sum_i p_i * logits_i (its use_weighted_exit).
    initial_state (Huginn only): s_0 [T, H], 'zero', or None for the position-keyed random state.
    Returns the family's output: `logits [T,V]` f32 (exit-selected), `loop_logits [L,T,V]`,
    `loop_hidden [L,T,H]`; Ouro adds `gate_logits [L,T]`, `exit_loop [T]` (the selected loop's
    0-based index: generate's `exit_loops` counts loops, exit_loop + 1) and the exit
    distribution `exit_pdf`, `exit_cdf [L,T]`; Huginn `latents [T,H]`.
    """
    cfg = model.cfg
    ids = _check_ids(input_ids, cfg.vocab_size)
    module = checkpoint.model_module(cfg)
    kwargs: dict[str, Any] = {}
    if loops is not None:
        if isinstance(loops, bool) or not isinstance(loops, int | np.integer) or loops < 0:
            raise ValueError(f"loops must be a non-negative integer, got {loops!r}")
        kwargs["loops"] = int(loops)
    if cfg.family == "ouro":
        if initial_state is not None:
            raise ValueError("initial_state is a Huginn argument: Ouro's loops start from the "
                             "token embeddings")
        kwargs.update(_ouro_exit_rule(exit_threshold, exit_step, exit_weighted))
    else:
        given = [n for n, on in (("exit_threshold", exit_threshold is not None),
                                 ("exit_step", exit_step is not None),
                                 ("exit_weighted", exit_weighted)) if on]
        if given:
            raise ValueError(f"{given[0]} is an Ouro argument: Huginn has no exit gate "
                             "(choose the number of loops instead)")
        if initial_state is not None:
            kwargs["initial_state"] = initial_state
    return module.forward(model.params, cfg, ids, **kwargs)


def _ouro_exit_rule(exit_threshold, exit_step, exit_weighted) -> dict[str, Any]:
    """`ouro.forward`'s exit keywords, checked by SamplingParams' own rules (a threshold in
    [0, 1], an exit_step >= 0, one rule at most; numpy scalars are numbers)."""
    from loopjax.sampling_params import SamplingParams

    params = SamplingParams(exit_threshold=exit_threshold, exit_step=exit_step, exit_weighted=exit_weighted)
    kwargs: dict[str, Any] = {"exit_step": params.exit_step, "weighted": params.exit_weighted}
    if params.exit_threshold is not None:
        kwargs["exit_threshold"] = float(params.exit_threshold)
    return kwargs


def _check_ids(input_ids, vocab_size: int):
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
    if holds_bools(input_ids):  # True is no token id (the engine's prompts refuse it too)
        raise ValueError("input_ids must be integer token ids, not booleans")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary 0..{vocab_size - 1}")
    return jax.numpy.asarray(ids, dtype=jax.numpy.int32)
