"""Host time of the engine at the H200 workloads' sizes, no device: `python -m loopjax.bench.host_overhead`.

    python -m loopjax.bench.host_overhead                    # Ouro-1.4B shapes, 1 / 32 / 128 rows
    python -m loopjax.bench.host_overhead --rows 32 --steps 100 --out host.json
    python -m loopjax.bench.host_overhead --smoke            # a few steps (the tests)

The engine is the real one over --preset's config (its page tables, vocabulary and loops: the
page size and pool as EngineConfig's defaults give them), with no weights, no KV pool and no
step: `Runner.submit` returns canned outputs (bench/host_step.py's --no-device, with a token
drawn per row so that text grows). So what is timed is the host's work alone, steady and
without compiles: on CPU only ratios within one run count.

Cases: each R of --rows decodes R requests whose prompts are drawn in [--min-prompt,
--max-prompt] (contexts up to --max-context), greedy or sampled (temperature, top-p, top-k,
a seed), with or without detokenization (stop strings: each step decodes the new tokens; a
synthetic word-level tokenizer of the model's vocabulary). Phases of a decode step (median µs,
bench/host_step.py's): schedule, rows, make_batch, submit (the canned call), update, outputs,
other, host. `first dispatch` is a burst's first step: from the first of --burst requests'
add_request to its first Runner.submit (each request's checks, the scheduler's first prefill
plan and its batch), median of --burst-repeats fresh engines.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from unittest import mock

from loopjax.bench.common import ints, make_cli, write_json
from loopjax.bench.host_step import HOST_PHASES, phases

PHASES = (*HOST_PHASES, "other", "host")
SMOKE = dict(rows="2", steps=3, warmup_steps=2, burst=2, burst_repeats=1, max_context=256, min_prompt=16,
             max_prompt=64, preset="ouro-tiny")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="ouro-1.4b", help="model config (no weights are made)")
    parser.add_argument("--rows", default="1,32,128", help="comma-separated running requests")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per case")
    parser.add_argument("--warmup-steps", type=int, default=10, help="untimed decode steps before them")
    parser.add_argument("--min-prompt", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=1536)
    parser.add_argument("--max-context", type=int, default=2048, help="EngineConfig.max_context_len")
    parser.add_argument("--burst", type=int, default=32, help="requests of the first-dispatch burst")
    parser.add_argument("--burst-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--smoke", action="store_true", help=f"small run: {SMOKE}")


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of `vocab_size` ids (0 <unk>, then words 'w1'...) whose decoder
    joins words with spaces: detokenization's cost without a checkpoint's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def build(args, rows: int, detokenize: bool):
    """An Engine over the preset's config for `rows` requests, its runner's step canned."""
    import jax.numpy as jnp

    from loopjax import config as config_lib
    from loopjax import kv_cache
    from loopjax.engine import Engine, EngineConfig
    from loopjax.model import Model

    cfg = config_lib.preset(args.preset)
    model = Model(cfg=cfg, params={"dtype": jnp.zeros((), jnp.bfloat16)},
                  tokenizer=word_tokenizer(cfg.vocab_size) if detokenize else None)
    # NOTE: a pool of `rows` full contexts (the default one is capped by a memory budget)
    config = EngineConfig(max_num_rows=rows, max_context_len=args.max_context, warmup=False, verbose=False,
                          num_pages=rows * -(-args.max_context // EngineConfig.page_size))
    with mock.patch.object(kv_cache, "allocate_state", lambda *a, **k: None):  # no pool: no step runs
        engine = Engine(model, config)
    engine.runner.submit = _CannedStep(cfg.vocab_size, args.seed)
    gc.collect()  # NOTE: as Runner.warmup ends (no full collection of start-up's objects mid-burst)
    return engine


class _CannedStep:
    """Runner.submit without a device: a random token per row (a seeded draw), every loop run."""

    def __init__(self, vocab_size: int, seed: int):
        import numpy as np

        self.rng, self.vocab_size = np.random.default_rng(seed), vocab_size

    def __call__(self, batch, kind):
        import numpy as np

        from loopjax.steps import StepOut
        rows = batch.page_table.shape[0]
        return StepOut(self.rng.integers(3, self.vocab_size, rows).astype(np.int32),
                       np.full(rows, kind.num_loops, np.int32), np.zeros(rows, np.float32),
                       np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32),
                       np.ones(rows, np.int32))


def sampling(sampled: bool, detokenize: bool, max_tokens: int, seed: int):
    from loopjax.sampling_params import SamplingParams

    drawn = dict(temperature=0.8, top_p=0.95, top_k=50, seed=seed) if sampled else dict(temperature=0.0)
    # NOTE: a stop string that never matches: each step decodes its new tokens (update_text)
    text = dict(stop=["<never>"]) if detokenize else dict(detokenize=False)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **drawn, **text)


def prompts(args, count: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(count)]


def steady_engine(args, rows: int, sampled: bool, detokenize: bool):
    """(engine, timer): `rows` requests decoding, --warmup-steps decode steps of all of them run."""
    from loopjax.bench.profile import StageTimer

    engine = build(args, rows, detokenize)
    timer = StageTimer(engine)
    timer.wrap(engine, "_run", "engine_run")
    timer.wrap(engine, "_update", "engine_update")
    budget = args.max_context - args.max_prompt
    if budget < args.warmup_steps + args.steps + 4:
        raise ValueError(f"--max-context {args.max_context} leaves {budget} tokens after --max-prompt; the "
                         f"case needs {args.warmup_steps + args.steps + 4}")
    for i, prompt in enumerate(prompts(args, rows, engine.model.cfg.vocab_size, args.seed)):
        engine.add_request(prompt, sampling(sampled, detokenize, budget, args.seed + i))
    while not (timer.records and _full_decode(timer.records[-1], rows)):
        if not engine.has_unfinished():
            raise RuntimeError(f"the {rows} requests never decoded together")
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    return engine, timer


def _full_decode(record: dict, rows: int) -> bool:
    return record["kind"] == "decode" and record["rows"] == rows


def decode_case(args, rows: int, sampled: bool, detokenize: bool) -> dict:
    """Median µs per phase of `args.steps` decode steps of `rows` running requests."""
    engine, timer = steady_engine(args, rows, sampled, detokenize)
    start = len(timer.records)
    for _ in range(args.steps):
        engine.step()
    records = timer.records[start:]
    if not all(_full_decode(r, rows) for r in records):
        raise RuntimeError(f"a timed step was not a decode of {rows} rows")
    split = [phases(r) for r in records]
    return {p: 1e6 * statistics.median(s[p] for s in split) for p in PHASES}


def first_dispatch(args, sampled: bool, detokenize: bool) -> float:
    """µs from the first of a burst's add_request to its first Runner.submit (median of fresh engines)."""
    times = []
    for repeat in range(args.burst_repeats):
        engine = build(args, args.burst, detokenize)
        burst = prompts(args, args.burst, engine.model.cfg.vocab_size, args.seed + repeat)
        submit, sent = engine.runner.submit, []

        def first_submit(batch, kind, submit=submit, sent=sent):
            sent.append(time.perf_counter())
            return submit(batch, kind)
        engine.runner.submit = first_submit
        params = [sampling(sampled, detokenize, 16, args.seed + i) for i in range(len(burst))]
        start = time.perf_counter()
        for prompt, p in zip(burst, params):
            engine.add_request(prompt, p)
        engine.step()
        times.append(1e6 * (sent[0] - start))
    return statistics.median(times)


def format_table(results: list[dict]) -> str:
    lines = ["host phases of a decode step, median µs (no device)",
             f"{'rows':>5}{'sampled':>8}{'detok':>6}" + "".join(f"{p:>11}" for p in PHASES)]
    for res in results:
        lines.append(f"{res['rows']:>5}{res['sampled']!s:>8}{res['detokenize']!s:>6}"
                     + "".join(f"{res['median_us'][p]:>11.1f}" for p in PHASES))
    return "\n".join(lines)


def run(args) -> int:
    results, bursts = [], []
    for sampled, detokenize in ((False, False), (True, False), (True, True)):
        for rows in sorted(set(ints(args.rows))):
            results.append({"rows": rows, "sampled": sampled, "detokenize": detokenize,
                            "median_us": decode_case(args, rows, sampled, detokenize)})
        bursts.append({"sampled": sampled, "detokenize": detokenize,
                       "first_dispatch_us": first_dispatch(args, sampled, detokenize)})
    print(f"{args.preset} shapes, max_context_len {args.max_context}, prompts {args.min_prompt}-"
          f"{args.max_prompt} tokens")
    print(format_table(results))
    for b in bursts:
        print(f"burst of {args.burst}, sampled {b['sampled']}, detok {b['detokenize']}: first dispatch "
              f"{b['first_dispatch_us']:.1f} µs after the first add_request")
    sys.stdout.flush()
    write_json(args.out, {"preset": args.preset, "max_context": args.max_context,
                          "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
                          "burst": args.burst, "results": results,
                          "steps": args.steps, "warmup_steps": args.warmup_steps, "bursts": bursts})
    return 0


parser, main = make_cli("python -m loopjax.bench.host_overhead", __doc__, add_arguments, run, SMOKE)

if __name__ == "__main__":
    sys.exit(main())
