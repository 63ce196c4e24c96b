"""Read Hugging Face safetensors checkpoints (one file, or shards with an index) as numpy.

We parse the format ourselves instead of using `safetensors.numpy`, for two reasons:
numpy has no bfloat16 (released Ouro and Huginn weights are bf16; `ml_dtypes.bfloat16`
fills the gap), and a truncated or corrupt file must fail with one line naming the file,
before any tensor is used.

File layout: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data; offsets are relative to the first data byte. Tensors are memory-mapped, so opening a
checkpoint reads only headers; `TensorRef.read()` reads one tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from loopjax.hub_cache import is_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# PyTorch's pickled weights, which some repos hold instead (named in the error, never opened).
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# safetensors dtype names → numpy dtypes (ml_dtypes supplies the ones numpy lacks).
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}

# A header larger than this is certainly corruption (real headers are a few hundred KiB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A checkpoint file that cannot be read; the message is one line naming the file."""


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a safetensors file: its place, not its data."""

    file: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    num_bytes: int

    def read(self) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array (no copy until used)."""
        if self.num_bytes == 0:
            return np.zeros(self.shape, self.dtype)
        data = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.start, shape=(self.num_bytes,))
        return data.view(self.dtype).reshape(self.shape)


def read_header(path: str) -> dict[str, TensorRef]:
    """Every tensor of one safetensors file, validated against the file's size."""
    name = os.path.basename(path)
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{name} is truncated or not a safetensors file "
                                       f"({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, file_size - 8):
                raise SafetensorsError(f"{name} is truncated or corrupt (header claims "
                                       f"{header_len} bytes, file has {file_size})")
            raw = f.read(header_len)
    except OSError as e:
        raise SafetensorsError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{name} is corrupt: its header is not valid JSON ({e})") from None
    data_start = 8 + header_len
    data_len = file_size - data_start
    refs: dict[str, TensorRef] = {}
    for tensor_name, entry in header.items():
        if tensor_name == "__metadata__":
            continue
        refs[tensor_name] = _tensor_ref(path, name, tensor_name, entry, data_start, data_len)
    _check_no_overlap(name, refs)
    return refs


def _tensor_ref(path, file_name, tensor_name, entry, data_start, data_len) -> TensorRef:
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if not all(_is_int(n) for n in (*shape, begin, end)):  # int() would take 2.5, '64', 1e400 (raises)
            raise ValueError("not integers")
    except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{file_name} is corrupt: bad header entry for tensor "
                               f"{tensor_name!r}") from None
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:  # a list is unhashable
        raise SafetensorsError(f"{file_name}: tensor {tensor_name!r} has unsupported dtype "
                               f"{dtype_name}")
    dtype = DTYPES[dtype_name]
    num_bytes = math.prod(shape) * dtype.itemsize
    if begin < 0 or end - begin != num_bytes or any(d < 0 for d in shape):
        raise SafetensorsError(f"{file_name} is corrupt: tensor {tensor_name!r} spans bytes "
                               f"{begin}..{end} but {dtype_name}{list(shape)} needs {num_bytes}")
    if end > data_len:
        raise SafetensorsError(f"{file_name} is truncated: tensor {tensor_name!r} ends at data byte "
                               f"{end}, the file holds {data_len} data bytes")
    return TensorRef(path, tensor_name, dtype, shape, data_start + begin, num_bytes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_no_overlap(file_name: str, refs: dict[str, TensorRef]) -> None:
    """No two tensors share bytes (as the safetensors library requires): a header whose offsets
    overlap is corrupt, and would give one tensor another's values."""
    spans = sorted((r.start, r.start + r.num_bytes, name) for name, r in refs.items() if r.num_bytes)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise SafetensorsError(f"{file_name} is corrupt: tensors {first!r} and {second!r} "
                                   f"overlap in the file")


def open_checkpoint(hf_dir: str) -> dict[str, TensorRef]:
    """Every tensor of the checkpoint in `hf_dir`: `model.safetensors`, or the shards named
    by `model.safetensors.index.json` (each shard must exist, and every indexed tensor must
    be in the shard the index names)."""
    single = os.path.join(hf_dir, SINGLE_FILE)
    index = os.path.join(hf_dir, INDEX_FILE)
    if is_file(single):
        return read_header(single)
    if is_file(index):
        return _open_sharded(hf_dir, index)
    pickled = [name for name in PICKLE_FILES if os.path.lexists(os.path.join(hf_dir, name))]
    hint = f" ({pickled[0]} is not read: loopjax reads safetensors only)" if pickled else ""
    raise SafetensorsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}{hint}")


def _open_sharded(hf_dir: str, index: str) -> dict[str, TensorRef]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("empty weight_map")
        bad = next((v for v in weight_map.values() if not isinstance(v, str)), None)
        if bad is not None:
            raise ValueError(f"weight_map names shard {bad!r}, not a file name")
    except (ValueError, KeyError, TypeError) as e:
        raise SafetensorsError(f"{INDEX_FILE} is corrupt: {e}") from None
    shards: dict[str, dict[str, TensorRef]] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(hf_dir, str(shard))
        if os.path.basename(str(shard)) != shard or not is_file(shard_path):
            raise SafetensorsError(f"{INDEX_FILE} names shard {shard!r}, which is not a file in {hf_dir}")
        shards[shard] = read_header(shard_path)
    refs: dict[str, TensorRef] = {}
    for tensor_name, shard in weight_map.items():
        if tensor_name not in shards[shard]:
            raise SafetensorsError(f"{INDEX_FILE} puts tensor {tensor_name!r} in {shard}, "
                                   f"which does not contain it")
        refs[tensor_name] = shards[shard][tensor_name]
    for shard, shard_refs in shards.items():
        for tensor_name in shard_refs:
            if tensor_name not in weight_map:
                raise SafetensorsError(f"tensor {tensor_name!r} is in {shard} but not in {INDEX_FILE}")
    return refs
