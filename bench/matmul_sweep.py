"""Block-size candidates of `python -m loopjax.bench.matmul --sweep` (and `--wide`), and the
per-bucket totals from which the sweep prints its TUNED table (kernels/streaming_config.py)."""

from __future__ import annotations

try:
    from loopjax.kernels import streaming_matmul as sm
except ImportError:  # NOTE: run from a checkout with PYTHONPATH=. (kernels/ not installed)
    from kernels import streaming_matmul as sm


def sweep_configs(m, k, n, dtype):
    """pick_config's choice, then other weight tiles (each with its default split) and
    pipeline depths; valid and deduplicated."""
    base = sm.pick_config(m, k, n, dtype)
    cands = [base]
    for bn, bk in ((64, 64), (128, 64), (64, 128), (128, 128), (256, 32)):
        cands.append(base._replace(block_n=bn, block_k=bk,
                                   split_k=sm.default_split(m, k, n, bn, bk)))
    # NOTE: no split (so no XLA reduction kernel after it): the narrowest tile giving ~1
    # column block per SM.
    narrow = max(16, min(256, sm.next_pow2(max(1, n // sm.NUM_SMS)) // 2 or 16))
    cands.append(base._replace(block_n=narrow, block_k=128, split_k=1))
    cands += [base._replace(num_stages=st) for st in (3, 6)]
    cands.append(base._replace(split_k=min(16, max(1, k // base.block_k), 2 * base.split_k)))
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def wide_configs(m, k, n, dtype):
    """sweep_configs, then weight tiles of 32-128 columns x 64-256 rows (<= 32 KB), each with
    the split that runs about 1, 2 or 4 programs per SM, 4 tiles in flight (fewer where
    shared memory is short); valid and deduplicated."""
    out = sweep_configs(m, k, n, dtype)
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            if bn * bk > 128 * 128 or bk > k:
                continue
            cols = -(-n // bn)
            for programs in (sm.NUM_SMS, 2 * sm.NUM_SMS, 4 * sm.NUM_SMS):
                split = max(1, min(16, k // bk, round(programs / cols)))
                cfg = sm.Config(bn, bk, split, 4, 4)
                if cfg not in out:
                    out.append(cfg)
    return out


def add_totals(totals: dict, key, case) -> None:
    """Sum each config's time over the row counts of one block_m bucket; a config that
    fails or mismatches for any of them drops out."""
    good = {r["cfg"]: r["us"] for r in case
            if r["impl"] == "pallas" and "error" not in r and r["err"] <= 2e-2}
    if key not in totals:
        totals[key] = good
    else:
        totals[key] = {c: t + good[c] for c, t in totals[key].items() if c in good}
