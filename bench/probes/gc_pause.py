"""Probe: how long one full garbage collection stalls the host once an engine is built, and
after `gc.freeze()` (what `loopjax serve` does after start-up; bench/RESULTS.md run 20).

    python -m loopjax.bench.probes.gc_pause [--preset ouro-tiny] [--warmup]

Prints the objects the collector tracks and the milliseconds of three full collections each
way. On a CPU host use the tiny presets (their engine builds in seconds)."""

from __future__ import annotations

import argparse
import gc
import time


def _full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ouro-tiny")
    parser.add_argument("--warmup", action="store_true", help="compile every bucket (slower on CPU)")
    args = parser.parse_args(argv)
    import loopjax
    from loopjax.engine import Engine, EngineConfig

    model = loopjax.load(args.preset)
    engine = Engine(model, EngineConfig(max_num_rows=8, decode_row_buckets=(8,), max_prefill_tokens=64,
                                        prefill_token_buckets=(64,), max_prefill_rows=2, max_context_len=128,
                                        warmup=args.warmup, verbose=False))
    compiled = engine.runner.compilations
    print(f"{args.preset}: {len(gc.get_objects())} objects tracked, engine built ({compiled} compilations)")
    print("full collection, ms:", ", ".join(f"{_full_collection_ms():.1f}" for _ in range(3)))
    gc.freeze()
    print(f"after gc.freeze() ({gc.get_freeze_count()} objects frozen), ms:",
          ", ".join(f"{_full_collection_ms():.1f}" for _ in range(3)))
    gc.unfreeze()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
