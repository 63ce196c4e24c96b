"""Configuration and input validation of the weight-streaming matmul
(kernels/streaming_matmul.py; the Mosaic GPU variant shares `Config` and the validation):
block sizes from `TUNED` (measured on the H200 by `python -m loopjax.bench.matmul --sweep`),
else from `default_config`, then explicit overrides; the shared one-line input errors.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from ._common import NUM_SMS, SMEM_BUDGET, is_pow2, next_pow2

MAX_ROWS = 128  # one row block holds every row; past this, weights are no longer the cost
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class Config(NamedTuple):
    block_n: int  # weight tile columns (power of two >= 16)
    block_k: int  # weight tile rows (power of two >= 16)
    split_k: int  # programs sharing one column block's K range (fp32 partials if > 1)
    num_warps: int
    num_stages: int  # weight tiles in flight (Triton software pipelining)


# Tuned for bf16 on the H200: (K, N, block_m) -> Config(block_n, block_k, split_k, num_warps,
# num_stages), the fastest of `python -m loopjax.bench.matmul --sweep --rows 8,32,1` summed over
# the bucket's rows (bench/RESULTS.md run 11, jax 0.11.2); (2048, 2048), (5632, 2048) and
# (5280, 5280) from run 15's `--sweep --wide`, which times each product as the step runs it
# (Ouro's wo and w_down with their partials into norm_add_norm). Shapes of the product as the
# kernel sees them (for the SiLU epilogues N = 2F).
TUNED: dict[tuple[int, int, int], Config] = {
    (2048, 2048, 16): Config(64, 128, 4, 4, 4),
    (2048, 2048, 32): Config(64, 64, 8, 4, 3),
    (2048, 6144, 16): Config(32, 128, 1, 4, 4),
    (2048, 6144, 32): Config(32, 128, 1, 4, 4),
    (2048, 11264, 16): Config(64, 128, 1, 4, 4),
    (2048, 11264, 32): Config(64, 128, 1, 4, 4),
    (2048, 49152, 16): Config(128, 64, 1, 4, 4),
    (2048, 49152, 32): Config(128, 64, 1, 4, 3),
    (5280, 5280, 16): Config(128, 64, 6, 4, 4),
    (5280, 5280, 32): Config(128, 64, 3, 4, 4),
    (5280, 15840, 16): Config(64, 64, 1, 4, 4),
    (5280, 15840, 32): Config(64, 64, 1, 4, 4),
    (5280, 35840, 16): Config(128, 64, 1, 4, 3),
    (5280, 35840, 32): Config(128, 64, 1, 4, 3),
    (5280, 65536, 16): Config(128, 64, 1, 4, 3),
    (5280, 65536, 32): Config(128, 64, 1, 4, 3),
    (5632, 2048, 16): Config(64, 128, 8, 4, 4),
    (5632, 2048, 32): Config(64, 128, 4, 4, 4),
    (17920, 5280, 16): Config(64, 64, 3, 4, 4),
    (17920, 5280, 32): Config(64, 64, 3, 4, 4),
}


# ------------------------------------------------------------------------------ validation


def check_matmul_inputs(x, w, residual=None, *, gate_up: bool = False, norm_weight=None,
                        norm_eps=None):
    """Shared validation: raises ValueError with a one-line message; returns (M, K, N)."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N], got shapes {x.shape} and {w.shape}")
    (m, k), (k_w, n) = x.shape, w.shape
    if k != k_w:
        raise ValueError(f"x [M, K={k}] and w [K={k_w}, N] disagree on K")
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"x and w must share a float32/bfloat16/float16 dtype, got {x.dtype}, {w.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"streaming_matmul takes 1..{MAX_ROWS} rows, got M={m} (use layers.linear)")
    if k == 0 or n == 0:
        raise ValueError(f"empty product: x {x.shape}, w {w.shape}")
    if gate_up and n % 2:
        raise ValueError(f"w_gate_up must be [K, 2F] (columns [gate | up]), got N={n}")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype}, got {residual.shape} {residual.dtype}")
    if norm_weight is not None:
        if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
            raise ValueError(f"norm_weight must be [{k}] (K) {x.dtype}, got {norm_weight.shape} "
                             f"{norm_weight.dtype}")
        if norm_eps is None:
            raise ValueError("norm_eps is required with norm_weight")
    return m, k, n


def _check_config(cfg: Config, k: int) -> None:
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if not (is_pow2(v) and v >= 16):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton dot tiles), got {v}")
    num_k_blocks = max(1, k // cfg.block_k)
    if not 1 <= cfg.split_k <= num_k_blocks:
        raise ValueError(f"split_k must be in 1..{num_k_blocks} (K={k} / block_k={cfg.block_k}), "
                         f"got {cfg.split_k}")
    if cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"num_warps and num_stages must be >= 1, got {cfg.num_warps}, {cfg.num_stages}")


def block_rows(m: int) -> int:
    """The row block (Triton dot tiles need >= 16 rows)."""
    return max(16, next_pow2(m))


def default_split(m: int, k: int, n: int, block_n: int, block_k: int) -> int:
    """K splits for ~2 programs per SM. NOTE: the fp32 partials of a split cost
    split_k * M * N * 4 bytes of traffic; they are kept under half the weight's bytes."""
    col_blocks = -(-n // block_n)
    split_k = min(16, max(1, k // block_k), round(2 * NUM_SMS / col_blocks), k // (4 * m))
    return max(1, split_k)


def default_config(m: int, k: int, n: int, dtype=jnp.bfloat16) -> Config:
    """Heuristic for shapes missing from TUNED: 8 KB weight tiles ([64, 64] bf16, [32, 64]
    fp32; [64, 128] when the columns alone give > 1 program per SM), `default_split`, 4
    tiles in flight."""
    bm = block_rows(m)
    block_n = 128 if (bm <= 32 and n >= 128 * NUM_SMS) else 64
    block_n = min(block_n, max(16, next_pow2(n)))
    block_k = min(64 if jnp.dtype(dtype).itemsize < 4 else 32, max(16, next_pow2(k)))
    split_k = default_split(m, k, n, block_n, block_k)
    return Config(block_n, block_k, split_k, 8 if bm >= 64 else 4, 4)


def _fit_stages(cfg: Config, block_m: int, weight_tiles: int, itemsize: int) -> Config:
    """Fewer stages when the pipelined tiles would not fit in shared memory (~200 KB)."""
    per_stage = (block_m * cfg.block_k + weight_tiles * cfg.block_k * cfg.block_n) * itemsize
    return cfg._replace(num_stages=max(1, min(cfg.num_stages, SMEM_BUDGET // per_stage)))


def pick_config(m: int, k: int, n: int, dtype=jnp.bfloat16, **overrides) -> Config:
    """TUNED[(K, N, block_m)] or default_config, then any non-None keyword overrides."""
    cfg = TUNED.get((k, n, block_rows(m))) or default_config(m, k, n, dtype)
    if jnp.dtype(dtype).itemsize == 4 and (k, n, block_rows(m)) in TUNED:
        cfg = cfg._replace(block_k=max(16, cfg.block_k // 2))  # NOTE: same tile bytes as bf16
    return cfg._replace(**{key: v for key, v in overrides.items() if v is not None})


