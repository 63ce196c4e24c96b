"""Helpers shared by the Pallas kernels of this folder (Triton-lowered `pl.pallas_call`).

Triton blocks must have power-of-two sizes: widths that are not (head_dim 96, hidden 5280)
are covered by power-of-two column chunks, and row tails by masked loads and stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NUM_SMS = 132  # the H200's streaming multiprocessors: the grids' sizing rules start from it
# Shared memory a kernel's own buffers (rings, slots, staging) may take per block: of the H200's
# 227 KB, the rest is left to barriers and the compiler's scratch (Triton's, Mosaic's reductions).
SMEM_BUDGET = 200 * 1024


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def pow2_chunks(width: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) power-of-two chunks covering [0, width), largest first (96 -> 64 + 32)."""
    chunks, off = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            chunks.append((off, 1 << bit))
            off += 1 << bit
    return tuple(chunks)


def next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def tile_mask(r0, block_rows: int, num_rows: int, width: int, valid_cols: int):
    """[block_rows, width] bool: rows r0.. below num_rows and local columns below
    valid_cols (the last row block may run past N; power-of-two tiles past the width)."""
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (block_rows, width), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (block_rows, width), 1)
    return (rows < num_rows) & (cols < valid_cols)


def load_tile(ref, r0, block_rows: int, c0, width: int, num_rows: int, valid_cols: int):
    """ref[r0:r0+block_rows, c0:c0+width] of a 2-D ref; entries outside read as 0."""
    mask = tile_mask(r0, block_rows, num_rows, width, valid_cols)
    return plgpu.load(ref.at[pl.ds(r0, block_rows), pl.ds(c0, width)], mask=mask, other=0)


def store_tile(ref, r0, c0, value, num_rows: int, valid_cols: int):
    """ref[r0:r0+rows, c0:c0+width] = value [rows, width], inside the array only."""
    block_rows, width = value.shape
    mask = tile_mask(r0, block_rows, num_rows, width, valid_cols)
    plgpu.store(ref.at[pl.ds(r0, block_rows), pl.ds(c0, width)], value, mask=mask)


def load_vec(ref, c0, width: int, valid: int):
    """ref[c0:c0+width] of a 1-D ref; entries at local index >= valid read as 0."""
    mask = jax.lax.broadcasted_iota(jnp.int32, (width,), 0) < valid
    return plgpu.load(ref.at[pl.ds(c0, width)], mask=mask, other=0)


def div_rn(x, y, interpret: bool):
    """IEEE round-to-nearest f32 x / y, as XLA divides. NOTE: Triton lowers `/` to the
    approximate div.full.f32, so on the GPU the division is spelled in PTX."""
    if interpret:
        return x / y
    x, y = jnp.broadcast_arrays(x.astype(jnp.float32), y.astype(jnp.float32))
    [out] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret mode unless the default backend is a GPU (CPU tests, CPU engines)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm") if interpret is None else interpret


@functools.cache
def mosaic_gpu_problem() -> str | None:
    """Why this process's GPU cannot run the Mosaic GPU kernels (they issue wgmma and TMA
    copies: Hopper, compute capability 9.x), or None: it can, or the backend is no GPU (on a
    CPU host they run in the interpreter or are lowered for an abstract H200)."""
    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]  # NOTE: none on a CPU host
    kinds = {(d.device_kind, str(getattr(d, "compute_capability", "unknown"))) for d in gpus}
    others = sorted(f"{kind} (compute capability {cap})" for kind, cap in kinds if not cap.startswith("9."))
    if others:
        return (f"the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x), not "
                f"{', '.join(others)}")
    return None


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def one_lowering_per_config(*static_argnames: str):
    """Decorator for a kernel's call: jit it with its configuration arguments static, so the
    call sites of one step with the same shapes and configuration (a layer each) share ONE
    lowering (JAX lowers a jitted function once per module and calls it from each site).
    Unshared, every site lowered its own kernel (a 1-row Ouro-1.4B decode step: 97 Triton
    kernels for 5 distinct products), and every Mosaic GPU site got its own kernel hash, so XLA
    compiled the same kernel once per site at start-up under jaxlib's process-wide Mosaic
    lock (warm-up 148.6 -> 23.7 s on the H200, bench/RESULTS.md run 10)."""
    return functools.partial(jax.jit, static_argnames=static_argnames)
