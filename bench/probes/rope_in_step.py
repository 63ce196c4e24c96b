"""Probe: the Ouro-1.4B decode step with the qkv + RoPE kernel's other block sizes (the
32-row step's worst product). Each configuration replaces TUNED's entry for the qkv shape at
the row bucket (which sets the fused kernel's block_k, warps and stages; its block_n comes from
TUNED_ROPE_BLOCK_N), then times the step as `decode_step` does, in-process.

    python -m loopjax.bench.probes.rope_in_step --rows 32 --configs "k128w4s4,k128w4s6,k64w4s8"
    python -m loopjax.bench.probes.rope_in_step --smoke
"""

from __future__ import annotations

import argparse
import re

from loopjax.bench import decode_step
from loopjax.kernels import streaming_config as sc


def parse(text: str) -> dict:
    """'k128w4s6' -> dict(block_k=128, num_warps=4, num_stages=6)."""
    match = re.fullmatch(r"k(\d+)w(\d+)s(\d+)", text)
    if not match:
        raise ValueError(f"config {text!r}: expected k<block_k>w<warps>s<stages>, e.g. k128w4s6")
    block_k, warps, stages = map(int, match.groups())
    return dict(block_k=block_k, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--configs", default="k128w4s4,k128w4s6,k64w4s8,k256w4s3,k128w8s4,k64w4s4")
    parser.add_argument("--smoke", action="store_true", help="ouro-tiny on CPU")
    args = parser.parse_args(argv)
    preset, shape = ("ouro-tiny", None) if args.smoke else ("ouro-1.4b", (2048, 6144))
    key = (*shape, sc.block_rows(args.rows)) if shape else None
    saved = sc.TUNED.get(key) if key else None
    status = 0
    for text in args.configs.split(","):
        cfg = parse(text)
        if key:
            sc.TUNED[key] = (saved or sc.default_config(args.rows, *shape))._replace(**cfg)
        print(f"== rope config {text}", flush=True)
        try:
            status |= decode_step.main(["--preset", preset, "--backend", "pallas_mgpu" if shape else "xla",
                                        "--matmul", "auto", "--per-loop-rows", "0", "--context",
                                        "512" if shape else "16", "--rows", str(args.rows),
                                        "--iters", "20" if shape else "1"])
        finally:
            if key and saved is not None:
                sc.TUNED[key] = saved
    return status


if __name__ == "__main__":
    raise SystemExit(main())
