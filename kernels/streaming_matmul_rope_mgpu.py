"""Ouro's qkv product with its RoPE in the epilogue on Mosaic GPU (`pallas.mosaic_gpu`): the
contract of kernels/streaming_matmul_rope.py's Triton kernel, for 1-8 rows or multiples of 8
up to 64 (the decode buckets 1, 8, 16, 32, 64) and D = 128.

    streaming_matmul_rope_qkv_mgpu(x [M, K], w_qkv [K, (Hq + 2*Hkv) * D], cos, sin [M, D/2] f32,
                                   num_heads=Hq, num_kv_heads=Hkv) -> q [M, Hq, D], k, v [M, Hkv, D]
      = layers.linear_rope_rotate_half_qkv: the product rounded to x's dtype, q and k heads
        rotated with kernels/rope.py's roundings, v heads as they are.

Why: at 17-32 rows the Triton kernel's programs each stream two 32-column strips of a head
(64-byte weight rows, 96 programs): 12.4 us per layer application for 25 MB, 49% of the copy
rate, the step's least efficient product (bench/RESULTS.md run 16).

Layout. One program per head (Hq + 2*Hkv programs). A head's halves are two [block_k, 64]
weight tiles per K step, TMA-copied into two rings of `num_stages` swizzled shared-memory
slots; each tile is wgmma's 64-row A operand through a transposed view (out^T = w_tile^T @
x^T, as kernels/persistent_mlp.py), x's [M, block_k] tile the B operand, so the two fp32
accumulators hold the head's halves transposed, [64, M]. x's whole K range is loaded once
when it fits X_ONCE_BYTES. The epilogue rounds both halves to the dtype, rotates q and k
heads with cos, sin read through a transposed view (kernels/rope.py's `_rotated_halves`) and
stores each half through a transposed view of its output, in the register layout that store
wants (WGMMA_TRANSPOSED). Where M is its own row padding (8, 16, 32, 64) the stores write
whole [M, 64] tiles straight to the outputs and cos, sin are read from them; M of 1-7 (the
1-row step) go through shared memory both ways, by TMA, which zero-fills the rows past
M on the way in and clips them on the way out. `shape_problem` says which shapes it refuses,
and the op keeps the Triton kernel there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from ._common import SMEM_BUDGET, one_lowering_per_config, resolve_interpret
from ._mgpu import b_rows, stream_tiles, tile_transforms
from .rope import _rotated_halves
from .streaming_matmul_rope import check_matmul_rope_inputs, ref_streaming_matmul_rope_qkv

__all__ = ["ref_streaming_matmul_rope_qkv", "shape_problem", "streaming_matmul_rope_qkv_mgpu"]

HALF = 64  # a head's half: wgmma's A rows (so D = 128)
MAX_ROWS = 64  # x's rows padded to 8, 16, 32 or 64: wgmma's B widths used here
X_ONCE_BYTES = 32 * 1024  # x's K range up to this size is loaded whole, before the first tile
BLOCK_K = 128  # K per ring slot by default (bench/RESULTS.md run 18: 64 was slower at 16-64 rows)
F32 = jnp.float32


def shape_problem(x, w_qkv, num_heads: int, num_kv_heads: int, block_k: int = BLOCK_K) -> str | None:
    """Why this kernel cannot take these shapes (a one-line reason), or None when it can.
    Assumes inputs that passed check_matmul_rope_inputs."""
    (m, k), width = x.shape, w_qkv.shape[1]
    d = width // (num_heads + 2 * num_kv_heads)
    if x.dtype == F32:
        return "the Mosaic qkv + RoPE kernel takes bfloat16/float16 (wgmma would round fp32 to tf32)"
    if d != 2 * HALF:
        return f"the Mosaic qkv + RoPE kernel takes head_dim {2 * HALF}, got {d}"
    if m > MAX_ROWS or (m > 8 and m % 8):  # NOTE: x's TMA box is tiled by 8 rows
        return f"the Mosaic qkv + RoPE kernel takes 1-8 rows or a multiple of 8 up to {MAX_ROWS}, got {m}"
    if block_k not in (64, 128) or k % block_k:
        return f"the Mosaic qkv + RoPE kernel needs block_k 64 or 128 dividing K={k}, got {block_k}"
    return None


def default_num_stages(m: int, k: int, block_k: int, itemsize: int = 2) -> int:
    """As many ring slots as fit SMEM_BUDGET (one program per SM), at most the K steps."""
    rows, steps = b_rows(m), k // block_k
    x_once = rows * k * itemsize <= X_ONCE_BYTES
    stage = 2 * block_k * HALF * itemsize + (0 if x_once else rows * block_k * itemsize)
    staging = 0 if rows == m else 2 * rows * HALF * (4 + itemsize)  # cos, sin; the output halves
    budget = SMEM_BUDGET - (rows * k * itemsize if x_once else 0) - staging
    return max(2, min(steps, budget // stage))


def streaming_matmul_rope_qkv_mgpu(x, w_qkv, cos, sin, *, num_heads: int, num_kv_heads: int,
                                   block_k: int = BLOCK_K, num_stages: int | None = None,
                                   interpret: bool | None = None):
    """layers.linear_rope_rotate_half_qkv -> (q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D]);
    raises ValueError (one line) for shapes `shape_problem` rejects."""
    m, k, _ = check_matmul_rope_inputs(x, w_qkv, cos, sin, num_heads, num_kv_heads)
    problem = shape_problem(x, w_qkv, num_heads, num_kv_heads, block_k)
    if problem:
        raise ValueError(problem)
    stages = num_stages or default_num_stages(m, k, block_k, x.dtype.itemsize)
    # NOTE: >= 2 slots: a slot is refilled after the next tile's product is issued
    stages = min(max(2, stages), k // block_k)
    return _kernel_call(x, w_qkv, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        block_k=block_k, num_stages=stages, interpret=resolve_interpret(interpret))


@one_lowering_per_config("num_heads", "num_kv_heads", "block_k", "num_stages", "interpret")
def _kernel_call(x, w_qkv, cos, sin, *, num_heads: int, num_kv_heads: int, block_k: int,
                 num_stages: int, interpret: bool):
    (m, k), dtype = x.shape, x.dtype
    rows = b_rows(m)
    heads = (num_heads, num_kv_heads, num_kv_heads)
    d, steps = 2 * HALF, k // block_k
    x_once = rows * k * dtype.itemsize <= X_ONCE_BYTES
    staged = rows != m  # cos, sin in and the outputs out through shared memory (TMA)
    transforms = tile_transforms(HALF, dtype)  # 64 columns: the weight tiles (A) and x (B)
    wt = plmgpu.Layout.WGMMA_TRANSPOSED  # what a store through a transposed view wants

    def body(x_ref, w_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, w1_smem, w2_smem, x_smem,
             w_ready, x_ready, *staging):
        # x [M, K]; w [K, (Hq + 2*Hkv) * D]; cos, sin [M, 64] f32; q [M, Hq * D]; k, v [M, Hkv * D]
        # staging (M < rows): cos and sin [2, rows, 64] f32, their barrier, the output halves
        h = jax.lax.axis_index("h")
        if staged:
            cs_smem, cs_ready, out_smem = staging
            for i, a in enumerate((cos_ref, sin_ref)):
                plmgpu.copy_gmem_to_smem(a.at[pl.ds(0, rows)], cs_smem.at[i], cs_ready)

        def fetch_w(t, slot):
            for w_smem, col in ((w1_smem, h * d), (w2_smem, h * d + HALF)):
                plmgpu.copy_gmem_to_smem(w_ref.at[pl.ds(t * block_k, block_k), pl.ds(col, HALF)],
                                         w_smem.at[slot], w_ready.at[slot])

        def fetch_x(t, slot):
            plmgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, rows), pl.ds(t * block_k, block_k)],
                                     x_smem.at[t if x_once else slot], x_ready.at[0 if x_once else slot])

        for t in range(num_stages):
            fetch_w(t, t)
        for t in range(steps if x_once else num_stages):
            fetch_x(t, t)

        def scope(acc1, acc2):  # [64, M] f32 each: the head's halves, transposed
            def fetch(t, slot):
                fetch_w(t, slot)
                if not x_once:
                    fetch_x(t, slot)

            def multiply(t, slot):
                x_t = (x_smem.at[t] if x_once else x_smem.at[slot]).T
                plmgpu.wgmma(acc1, w1_smem.at[slot].T, x_t)
                plmgpu.wgmma(acc2, w2_smem.at[slot].T, x_t)

            if x_once:
                plmgpu.barrier_wait(x_ready.at[0])
            stream_tiles(steps, num_stages, (w_ready,) if x_once else (w_ready, x_ready), fetch,
                         multiply, groups=2)
            plmgpu.wgmma_wait(0)
            # NOTE: the product is rounded to the dtype before the RoPE, as layers.linear rounds it
            x1, x2 = (plmgpu.layout_cast(a[...].astype(dtype).astype(F32), wt) for a in (acc1, acc2))

            def store(o_ref, head, halves):  # head's columns [head*D, +64) and [head*D + 64, +64)
                for i, (off, val) in enumerate(zip((0, HALF), halves, strict=True)):
                    cols = pl.ds(head * d + off, HALF)
                    if not staged:
                        o_ref.at[:, cols].T[...] = val.astype(dtype)
                        continue
                    out_smem.at[i].T[...] = val.astype(dtype)
                    plmgpu.commit_smem()
                    plmgpu.copy_smem_to_gmem(out_smem.at[i], o_ref.at[pl.ds(0, rows), cols])
                if staged:
                    plmgpu.wait_smem_to_gmem(0)  # the copies have read shared memory

            def rotated():
                if staged:
                    plmgpu.barrier_wait(cs_ready)
                    cs = (cs_smem.at[0], cs_smem.at[1])
                else:
                    cs = (cos_ref, sin_ref)
                cos_t, sin_t = (plmgpu.load(a.T, layout=wt, optimized=False) for a in cs)
                return _rotated_halves(x1, x2, cos_t, sin_t, dtype)

            hk = num_heads + num_kv_heads
            pl.when(h < num_heads)(lambda: store(q_ref, h, rotated()))
            pl.when((h >= num_heads) & (h < hk))(lambda: store(k_ref, h - num_heads, rotated()))
            pl.when(h >= hk)(lambda: store(v_ref, h - hk, (x1, x2)))

        acc = plmgpu.ACC((HALF, rows), F32)
        pl.run_scoped(scope, acc, acc)

    smem = lambda *shape: plmgpu.SMEM(shape, dtype, transforms=transforms)  # noqa: E731
    scratch = [smem(num_stages, block_k, HALF), smem(num_stages, block_k, HALF),
               smem(steps if x_once else num_stages, rows, block_k),
               plmgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
               plmgpu.Barrier(num_arrivals=steps, num_barriers=1) if x_once
               else plmgpu.Barrier(num_arrivals=1, num_barriers=num_stages)]
    if staged:
        scratch += [plmgpu.SMEM((2, rows, HALF), F32), plmgpu.Barrier(num_arrivals=2),
                    plmgpu.SMEM((2, rows, HALF), dtype)]
    out_type = [jax.ShapeDtypeStruct((m, n * d), dtype) for n in heads]
    outs = plmgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(sum(heads),),
                         grid_names=("h",), kernel_name="loopjax_streaming_matmul_rope_mgpu",
                         interpret=plmgpu.InterpretGPUParams() if interpret else None)(
        x, w_qkv, cos, sin)
    return tuple(o.reshape(m, n, d) for o, n in zip(outs, heads, strict=True))
