"""GPU check of the Mosaic decode kernel that writes the step's K/V (`paged_attention_mgpu_write`)
against XLA's `write_kv` then `ref_paged_attention`, at the Ouro-1.4B and Huginn-0125 decode
shapes: the pools must be bitwise equal, the output within fp32-accumulation tolerance (and
close to the two-kernel Mosaic path's). One row writes to the drop slot (nothing written).

    python -m loopjax.bench.probes.attn_write_check [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.kernels.paged_attention import ref_paged_attention, write_kv
from loopjax.kernels.paged_attention_mgpu import paged_attention_mgpu, paged_attention_mgpu_write

CASES = (  # name, rows, q heads, kv heads, head_dim, context (1 row, and 4 rows at 8,192: split contexts)
    ("ouro-1.4b", 1, 16, 16, 128, 512), ("ouro-1.4b", 8, 16, 16, 128, 512),
    ("ouro-1.4b", 32, 16, 16, 128, 600), ("huginn-0125", 8, 55, 55, 96, 512),
    ("ouro-1.4b", 1, 16, 16, 128, 8192), ("ouro-1.4b", 4, 16, 16, 128, 8192),
    ("huginn-0125", 1, 55, 55, 96, 512),
)
PAGE, PLANES, ATOL = 16, 2, 3e-2


def check(name, rows, hq, hkv, d, context, seed=0):
    rs = np.random.default_rng(seed)
    pages_per_row = -(-(context + 1) // PAGE)
    num_pages = rows * pages_per_row + 4
    shape = (PLANES, hkv, num_pages, PAGE, d)
    k_pool, v_pool = (jnp.asarray(rs.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    table = rs.permutation(num_pages)[: rows * pages_per_row].reshape(rows, pages_per_row)
    table = jnp.asarray(table, jnp.int32)
    positions = jnp.asarray(rs.integers(context // 2, context, rows), jnp.int32)
    slots = table[jnp.arange(rows), positions // PAGE] * PAGE + positions % PAGE
    slots = slots.at[rows - 1].set(num_pages * PAGE)  # the drop slot: nothing written
    q = jnp.asarray(rs.standard_normal((rows, hq, d)), jnp.bfloat16)
    k_new, v_new = (jnp.asarray(rs.standard_normal((rows, hkv, d)), jnp.bfloat16) for _ in range(2))
    rows_of = jnp.arange(rows, dtype=jnp.int32)
    plane = jnp.int32(1)

    @jax.jit
    def reference(k_pool, v_pool):
        kc, vc = write_kv(k_pool, v_pool, plane, slots, k_new, v_new)
        return ref_paged_attention(q, kc, vc, plane, table, rows_of, positions), kc, vc

    @jax.jit
    def two_kernels(k_pool, v_pool):
        kc, vc = write_kv(k_pool, v_pool, plane, slots, k_new, v_new)
        return paged_attention_mgpu(q, kc, vc, plane, table, rows_of, positions)

    fused = jax.jit(functools.partial(paged_attention_mgpu_write, q, k_new, v_new, slots))
    ref_out, ref_k, ref_v = reference(k_pool, v_pool)
    two_out = two_kernels(k_pool, v_pool)
    out, kc, vc = fused(k_pool, v_pool, plane, table, rows_of, positions)
    pools_equal = bool(jnp.array_equal(kc, ref_k)) and bool(jnp.array_equal(vc, ref_v))
    err_ref = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
    err_two = float(jnp.max(jnp.abs(out.astype(jnp.float32) - two_out.astype(jnp.float32))))
    ok = pools_equal and err_ref <= ATOL and np.isfinite(err_ref)
    print(f"{name:>12} rows {rows:>3} ctx {context:>4}: pools bitwise {pools_equal}, max |out - ref| "
          f"{err_ref:.3g}, max |out - two-kernel mosaic| {err_two:.3g}  {'ok' if ok else 'FAIL'}", flush=True)
    return ok


SMOKE_CASES = (("tiny", 2, 2, 2, 64, 40), ("tiny", 1, 2, 2, 64, 300))  # CPU interpreter; 1 row: splits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, the kernels' CPU interpreter")
    args = parser.parse_args(argv)
    print(f"attention write check on {jax.devices()[0].device_kind}")
    results = [check(*case) for case in (SMOKE_CASES if args.smoke else CASES)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
