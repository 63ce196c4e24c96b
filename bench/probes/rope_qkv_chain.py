"""Probe: Ouro's qkv product with the RoPE epilogue, Triton kernel vs the Mosaic GPU kernel
(kernels/streaming_matmul_rope_mgpu.py) and its configurations, as the decode step runs it:
a chain over 24 layers of distinct wqkv weights x 4 loops in one jitted `fori_loop` (x <- q).
Prints µs per layer application, % of the copy rate for the weight, and each arm's q, k, v
against the XLA twin at the real shapes (max |diff| / max |ref|).

Arms: 'triton' (streaming_matmul_rope_qkv, today's default), 'xla' (the twin), 'mgpu', and
'mgpu@k64t4' (block_k 64, 4 ring slots; either part alone); 'mm@n32k128t4s1' the plain Mosaic
product without the RoPE (block_n 32, block_k 128, 4 slots, no K split): other tilings' cost.

    python -m loopjax.bench.probes.rope_qkv_chain --rows 8,16,32,64 [--trace DIR] [--heads 16:16,16:2,8:8]
    python -m loopjax.bench.probes.rope_qkv_chain --smoke

--heads runs each case with those q:kv head counts (K = 128 * Hq; the Mosaic kernel runs
Hq + 2 * Hkv programs, one per head, each streaming K * 256 bytes): does the product's time
follow its bytes, its program count or each program's bytes?
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.bench.common import error_text, ints, names, tile_spec, time_calls, write_json
from loopjax.bench.matmul import COPY_RATE_REF
from loopjax.bench.trace_summary import trace_runs
from loopjax.kernels import streaming_matmul_rope as smr
from loopjax.kernels import streaming_matmul_rope_mgpu as smrm
from loopjax.kernels.streaming_matmul_mgpu import streaming_matmul_mgpu
from loopjax.layers import rope_angles, split_qkv


def product_only(x, w, cos, sin, *, num_heads: int, num_kv_heads: int, **config):
    """The plain Mosaic product (kernels/streaming_matmul_mgpu.py, x as wgmma's A operand) split
    into q, k, v WITHOUT the RoPE: what streaming the weight costs with other tilings (its
    q, k differ from the twin's by the rotation)."""
    del cos, sin
    return split_qkv(streaming_matmul_mgpu(x, w, **config), num_heads, num_kv_heads)


ARMS = {"triton": smr.streaming_matmul_rope_qkv, "xla": smr.ref_streaming_matmul_rope_qkv,
        "mgpu": smrm.streaming_matmul_rope_qkv_mgpu, "mm": product_only}


def arm_op(arm: str):
    """The arm's op (x, w, cos, sin, num_heads=, num_kv_heads=) -> (q, k, v); a spec after '@'
    sets k (block_k), t (num_stages), n (block_n) and s (split_k), e.g. mm@n32k128t4s1."""
    name, _, spec = arm.partition("@")
    return functools.partial(ARMS[name], **tile_spec(spec))


def chain_fn(op, heads: dict, num_loops: int):
    """(x [M, Hq * D], weights [(w_qkv,)] per layer, cos, sin) -> x after num_loops passes."""
    def run(x, weights, cos, sin):
        def one_loop(_, x):
            for w in weights:
                q, _, _ = op(x, w, cos, sin, **heads)
                x = q.reshape(x.shape)
            return x
        return jax.lax.fori_loop(0, num_loops, one_loop, x)
    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=ints, default=[8, 16, 32, 64])
    parser.add_argument("--arms", type=names, default=["triton", "mgpu", "mgpu@k64"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="also trace 2 runs per case under this folder")
    parser.add_argument("--heads", default=None, help="Hq:Hkv per case, comma-separated (default: 16:16)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = parser.parse_args(argv)
    num_layers, num_loops = (1, 1) if args.smoke else (24, 4)
    heads = args.heads or ("2:2" if args.smoke else "16:16")
    iters = 1 if args.smoke else args.iters
    records, status = [], 0
    for pair in heads.split(","):
        num_heads, num_kv_heads = map(int, pair.split(":"))
        status |= _cases(args, num_heads, num_kv_heads, num_layers, num_loops, iters, records)
    write_json(args.out, dict(backend=jax.default_backend(), records=records))
    return status


def _cases(args, num_heads: int, num_kv_heads: int, num_layers: int, num_loops: int, iters: int,
           records: list) -> int:
    """Every rows x arm case for one head count; appends records, returns 1 if an arm failed."""
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
    hidden, width = num_heads * 128, (num_heads + 2 * num_kv_heads) * 128
    keys = jax.random.split(jax.random.PRNGKey(0), num_layers)
    weights = [(jax.random.normal(key, (hidden, width), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
               for key in keys]
    status = 0
    for rows in args.rows:
        x = (jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)) * 0.5).astype(jnp.bfloat16)
        cos, sin = rope_angles(jnp.arange(rows) * 37 + 500, 128, 10000.0)
        want = [np.asarray(a, np.float32) for a in ARMS["xla"](x, weights[0], cos, sin, **heads)]
        for arm in args.arms:
            try:
                got = jax.jit(functools.partial(arm_op(arm), **heads))(x, weights[0], cos, sin)
                diff = max(float(np.max(np.abs(np.asarray(g, np.float32) - w)) / np.max(np.abs(w)))
                           for g, w in zip(got, want, strict=True))
                fn = functools.partial(chain_fn(arm_op(arm), heads, num_loops), x, weights, cos, sin)
                seconds = float(np.median(time_calls(fn, iters)))
            except Exception as e:  # noqa: BLE001 - one failing arm must not hide the others
                print(f"rows {rows:3d} {arm:12s} FAILED {error_text(e)}", flush=True)
                status = 1
                continue
            if args.trace:
                trace_runs(lambda fn=fn: jax.block_until_ready(fn()),
                           f"{args.trace}/{rows}_{num_heads}_{num_kv_heads}_{arm}", 2)
            per_layer = seconds / (num_layers * num_loops)
            pct = 100 * hidden * width * 2 / per_layer / COPY_RATE_REF
            records.append(dict(rows=rows, arm=arm, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                us_per_layer=per_layer * 1e6, pct_copy=pct, max_diff_vs_xla=diff))
            print(f"rows {rows:3d} heads {num_heads:2d}:{num_kv_heads:<2d} {arm:12s} "
                  f"{per_layer * 1e6:8.2f} µs/layer {pct:5.1f}% copy  "
                  f"q,k,v vs xla max|diff|/max|ref| {diff:.3g}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
