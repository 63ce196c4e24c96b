"""Hugging Face checkpoint → loopjax params, in memory (`load_hf`) or as a checkpoint folder
(`convert`).

Steps: config.json → family config (`config_from_hf`); safetensors headers (one file or
shards); the names and shapes against the family's key table (`hf_tensor_shapes`,
`IGNORED_HF_KEYS`): every missing, unexpected, mis-shaped or non-float tensor is an error
naming it; each tensor read and cast to the target dtype (progress bar for large checkpoints); the
family's `to_params`; the result checked against `param_specs`. Runtime code never sees
HF names: they live only in `convert/<family>_keys.py`.

`convert` writes into a temporary folder beside the output and renames it at the end, so a
failure (or Ctrl-C) never leaves a half-written checkpoint behind. A conversion killed outright
(SIGKILL, a crash) cannot remove it: the folder records its host and process, and the next
conversion to the same output removes it once that process is gone.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading

import numpy as np
from tqdm import tqdm

from loopjax import checkpoint, hub_cache
from loopjax import config as config_lib

from . import safetensors_reader

# Files copied verbatim from the HF folder when present (tokenizer, chat template, generation
# defaults); `config.json` is copied too so the original stays next to the weights.
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json",
             "merges.txt", "vocab.txt", "tokenizer.model")

# Above this many bytes of tensors the reader shows a progress bar.
PROGRESS_MIN_BYTES = 256 * 1024 * 1024

# In the temporary folder while it is written: {"host", "pid", "out"} of the conversion (removed
# before the rename).
OWNER_FILE = ".loopjax-convert-owner"


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message is one line naming the cause."""


def read_config(hf_dir: str) -> config_lib.ModelConfig:
    """The family config of the HF folder `hf_dir` (one line if it is missing or unsupported)."""
    if not os.path.exists(hf_dir):
        raise ConvertError(f"input folder {hf_dir} does not exist{hub_cache.missing_hint(hf_dir)}")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"input {hf_dir} is not a folder")
    if not hub_cache.is_file(os.path.join(hf_dir, "config.json")):
        hint = " (it is a loopjax checkpoint already)" if checkpoint.is_checkpoint(hf_dir) else ""
        raise ConvertError(f"no config.json in {hf_dir}{hint}")
    return config_lib.read_hf_config(hf_dir)


def check_tensor_names(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                       optional: dict[str, tuple[int, ...]] | None = None, is_ignored=None) -> None:
    """`shapes` (what the checkpoint holds) must have every `expected` name, nothing beyond
    `optional` names and names `is_ignored(name)` accepts, and the declared shapes; the first
    difference is raised, named."""
    optional = optional or {}
    missing = sorted(k for k in expected if k not in shapes)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"checkpoint lacks tensor {missing[0]!r}{more}")
    extra = sorted(k for k in shapes if k not in expected and k not in optional
                   and not (is_ignored and is_ignored(k)))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConvertError(f"checkpoint has unexpected tensor {extra[0]!r}{more}")
    declared = {**optional, **expected}
    for name in sorted(shapes):
        if name in declared and tuple(shapes[name]) != tuple(declared[name]):
            raise ConvertError(f"tensor {name!r} has shape {tuple(shapes[name])}, "
                               f"expected {tuple(declared[name])}")


def key_table(cfg, num_tensors: int):
    """(expected shapes, optional shapes, is_ignored) of the family's key table, for a checkpoint
    of `num_tensors` tensors. `IGNORED_HF_KEYS` entries are full-match patterns (a plain name
    matches itself)."""
    try:
        keys = importlib.import_module(f"loopjax.convert.{cfg.family}_keys")
    except ModuleNotFoundError:
        raise ConvertError(f"no HF key table for the {cfg.family} family") from None
    layers = cfg.num_distinct_layers
    if layers > num_tensors:  # every layer has tensors; the table of 10**6 layers took a minute
        raise ConvertError(f"config.json declares {layers} layers, but the checkpoint holds "
                           f"{num_tensors} tensors in all")
    expected = {k: tuple(v) for k, v in keys.hf_tensor_shapes(cfg).items()}
    optional_fn = getattr(keys, "optional_hf_tensor_shapes", None)
    optional = {k: tuple(v) for k, v in optional_fn(cfg).items()} if optional_fn else {}
    patterns = [re.compile(p) for p in getattr(keys, "IGNORED_HF_KEYS", ())]
    is_ignored = lambda name: any(p.fullmatch(name) for p in patterns)
    return keys, expected, optional, is_ignored


def default_dtype(refs: dict[str, safetensors_reader.TensorRef]) -> np.dtype:
    """The checkpoint's own float dtype if it is bf16 or fp32 (else bf16)."""
    float_dtypes = {r.dtype for r in refs.values() if _is_float(r.dtype)}
    if len(float_dtypes) == 1:
        only = float_dtypes.pop()
        if only in (np.dtype(np.float32), checkpoint.parse_dtype("bf16")):
            return only
    return checkpoint.parse_dtype("bf16")


def load_hf(hf_dir: str, dtype=None, progress: bool = True):
    """`(cfg, params)` from the HF folder `hf_dir`, params as numpy arrays in `dtype`
    (default: the checkpoint's own dtype). Writes nothing."""
    cfg = read_config(hf_dir)
    try:
        refs = safetensors_reader.open_checkpoint(hf_dir)
    except safetensors_reader.SafetensorsError as e:
        hint = " (it is a loopjax checkpoint already)" if checkpoint.is_checkpoint(hf_dir) else ""
        raise ConvertError(f"{e}{hint}") from None
    keys, expected, optional, is_ignored = key_table(cfg, len(refs))
    dtype = checkpoint.dtype_option(dtype)
    check_tensor_names({k: r.shape for k, r in refs.items()}, expected, optional, is_ignored)
    # Ignored tensors (e.g. a RoPE table) are never read, nor choose the default dtype; present
    # optional ones are read.
    names = sorted(k for k in refs if k in expected or (k in optional and not is_ignored(k)))
    dtype = default_dtype({k: refs[k] for k in names}) if dtype is None else checkpoint.parse_dtype(dtype)
    for name in names:  # every weight is floating point: an integer one would be cast silently
        if not _is_float(refs[name].dtype):
            raise ConvertError(f"tensor {name!r} has dtype {refs[name].dtype}, expected a float dtype")
    total_bytes = sum(refs[k].num_bytes for k in names)
    tensors = {}
    bar = tqdm(names, desc="reading tensors", unit="tensor", leave=False,
               disable=not progress or total_bytes < PROGRESS_MIN_BYTES)
    for name in bar:
        tensors[name] = _read(refs[name], dtype)
    try:
        params = keys.to_params(cfg, tensors)
    except ValueError as e:  # e.g. tied embeddings that differ
        raise ConvertError(str(e).splitlines()[0]) from None
    del tensors
    params = _cast_tree(params, dtype)
    specs = checkpoint.model_module(cfg).param_specs(cfg, dtype)
    try:
        checkpoint.check_against_specs(params, specs, "converted params")
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    return cfg, params


def _read(ref: safetensors_reader.TensorRef, dtype: np.dtype) -> np.ndarray:
    """One tensor, in memory, in `dtype` (only float tensors are cast)."""
    try:
        array = ref.read()
        if _is_float(array.dtype):
            return array.astype(dtype)  # astype copies: the result no longer maps the file
        return np.array(array)
    except (OSError, ValueError) as e:
        file = os.path.basename(ref.file)
        raise ConvertError(f"cannot read tensor {ref.name!r} from {file}: {e}") from None


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 / float8 are not numpy floating types (their kind is "V").
    return dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _cast_tree(params, dtype):
    import jax

    return jax.tree.map(lambda a: a if a.dtype == dtype else np.asarray(a).astype(dtype), params)


def convert(hf_dir: str, out_dir: str, dtype="bfloat16", progress: bool = True) -> str:
    """Convert the HF folder `hf_dir` into a new loopjax checkpoint folder `out_dir`.

    All-or-nothing: `out_dir` must not exist; everything is written to a temporary folder
    beside it and renamed at the end; on any failure nothing is left behind. Paths may be
    `os.PathLike` and start with '~'."""
    hf_dir = os.path.expanduser(os.fspath(hf_dir))
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    _check_output_free(out_dir)
    _remove_stale_temporaries(out_dir)
    hf_dir = hub_cache.resolve(hf_dir)  # a Hub name already in the local cache: its snapshot
    cfg, params = load_hf(hf_dir, dtype, progress=progress)
    _check_aux_files(hf_dir, cfg)  # before anything is written
    parent = os.path.dirname(out_dir)
    created: list[str] = []  # the folders above the output made here, removed on failure
    tmp = None
    try:
        _make_parents(parent, created)
        tmp = tempfile.mkdtemp(prefix=_temporary_prefix(out_dir), dir=parent)
        with open(os.path.join(tmp, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump(_owner(out_dir), f)
        with _interrupts_deferred():
            checkpoint.save(tmp, cfg, params)
        for name in AUX_FILES:
            src = os.path.join(hf_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, name))
        os.remove(os.path.join(tmp, OWNER_FILE))
        umask = os.umask(0o022)  # NOTE: read (os.umask has no getter) and put back at once
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint is an ordinary folder
        _check_output_free(out_dir)  # made while converting
        os.rename(tmp, out_dir)
        tmp = None
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            try:
                os.rmdir(folder)
            except OSError:
                break
        if isinstance(e, OSError):  # e.g. a read-only folder: name the output, not the temporary
            raise ConvertError(f"cannot write {out_dir}: {e.strerror or e}") from None
        code = re.search(r"\[os_error_code='(\d+)'\]", str(e)) if isinstance(e, ValueError) else None
        if code:  # Orbax's (TensorStore's) failed write, e.g. a full disk, names a temporary file
            raise ConvertError(f"cannot write {out_dir}: {os.strerror(int(code[1]))}") from None
        raise
    return out_dir


def _check_output_free(out_dir: str) -> None:
    """Nothing is at `out_dir` (a file there is named as one: 'folder ... exists' misled)."""
    if os.path.isfile(out_dir):
        raise ConvertError(f"output {out_dir} is an existing file")
    if os.path.lexists(out_dir):
        raise ConvertError(f"output folder {out_dir} already exists")


def _temporary_prefix(out_dir: str) -> str:
    # The name cut short: a 255-character output name must leave room for the prefix and suffix.
    return f".{os.path.basename(out_dir)[:64]}.tmp-"


def _owner(out_dir: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "out": os.path.basename(out_dir)}


def _remove_stale_temporaries(out_dir: str) -> None:
    """Remove the temporary folders beside `out_dir` that a conversion to `out_dir` left when it
    was killed outright, one stderr line each. Only folders of this user holding an `OWNER_FILE`
    for this output on this host whose process is gone: a running conversion's, a foreign
    folder's or one of another host (a shared disk) are never touched."""
    parent = os.path.dirname(out_dir)
    try:
        names = sorted(name for name in os.listdir(parent) if name.startswith(_temporary_prefix(out_dir)))
    except OSError:  # no parent yet: nothing to remove
        return
    for name in names:
        folder = os.path.join(parent, name)
        pid = _dead_owner(folder, out_dir)
        if pid is not None:
            shutil.rmtree(folder, ignore_errors=True)
            print(f"loopjax convert: removed {folder}, left by a conversion (process {pid}) that "
                  "was killed", file=sys.stderr)


def _dead_owner(folder: str, out_dir: str) -> int | None:
    """The pid of the conversion that made the temporary `folder` if it is ours and that process
    is gone, else None."""
    try:
        info = os.lstat(folder)
        with open(os.path.join(folder, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or not isinstance(owner, dict):
        return None
    pid = owner.get("pid")
    mine = {**_owner(out_dir), "pid": pid}
    if owner != mine or type(pid) is not int or pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return pid
    except OSError:  # e.g. PermissionError: it exists, as another user's
        return None
    return None


@contextlib.contextmanager
def _interrupts_deferred():
    """Ctrl-C (and SIGTERM, SIGHUP where the CLI handles them) during the block is delivered when
    it ends: Orbax writes in background threads that an exception in the main thread does not
    stop, and they would refill the temporary folder after its removal. Only in the main thread,
    and only for signals with a Python handler (SIGTERM's default kills at once: nothing to
    defer)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    handlers = {signum: handler for signum, handler in handlers.items() if callable(handler)}
    received = []
    for signum in handlers:
        signal.signal(signum, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if received:
        handlers[received[0]](received[0], None)  # the handler raises (KeyboardInterrupt, ...)


def _make_parents(parent: str, created: list[str]) -> None:
    """Create the missing folders above the output, outermost first, appending each to `created`
    as it is made (a later one may fail: a name too long, a read-only mount)."""
    missing = []
    folder = parent
    while not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise ConvertError(f"{folder} exists and is not a folder")
        missing.append(folder)
        folder = os.path.dirname(folder)
    for folder in reversed(missing):
        os.mkdir(folder)
        created.append(folder)


def _check_aux_files(folder: str, cfg) -> None:
    """The JSON files to copy parse, each to an object as HF writes them, tokenizer.json loads
    as a tokenizer, the EOS ids of config.json and generation_config.json are token ids and
    chat_template.jinja is UTF-8 (a broken file should fail now, not when the checkpoint is
    loaded or served)."""
    generation_config = None
    for name in AUX_FILES:
        path = os.path.join(folder, name)
        if hub_cache.is_file(path) and name.endswith(".json"):  # every name: a broken link is refused
            try:
                with open(path, encoding="utf-8") as f:  # as transformers reads them
                    data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConvertError(f"{name} in the input folder is not valid JSON: {e}") from None
            if not isinstance(data, dict):
                raise ConvertError(f"{name} in the input folder is not a JSON object")
            if name == "generation_config.json":
                generation_config = data
    config_lib.eos_token_ids(cfg, generation_config)  # a ConfigError naming the file
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        try:
            with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
                f.read()
        except UnicodeDecodeError as e:
            raise ConvertError(f"chat_template.jinja in the input folder is not UTF-8 text: {e}") from None
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConvertError(f"tokenizer.json in the input folder is not a tokenizer: {reason}") from None
