"""Probe: a greedy request's tokens and logprobs do not depend on whether a sampled request
shares its decode steps (the greedy-only executable vs the full sampler's), nor on arrival
order. Runs the same 8 greedy prompts alone, then with 8 top-p requests beside them.

    python -m loopjax.bench.probes.greedy_invariance [--preset ouro-1.4b] [--smoke]
"""

from __future__ import annotations

import argparse

import numpy as np

from loopjax.llm import LLM
from loopjax.sampling_params import SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--smoke", action="store_true", help="ouro-tiny, short prompts (CPU)")
    args = parser.parse_args(argv)
    preset = "ouro-tiny" if args.smoke else args.preset
    prompt_len, new = (12, 6) if args.smoke else (128, 32)
    llm = LLM(preset, max_num_rows=16, decode_row_buckets=(16,), max_context_len=256, verbose=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, llm.model.cfg.vocab_size, prompt_len).tolist() for _ in range(16)]
    warm = llm.engine.runner.compilations
    greedy = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0)
    alone = llm.generate(prompts[:8], greedy)  # every decode step: the greedy executable
    mixed = llm.generate(prompts, [greedy] * 8 + [SamplingParams(  # the full sampler's
        temperature=1.0, top_p=0.9, seed=i, max_tokens=new, logprobs=0) for i in range(8)])
    same_tokens = all(a.token_ids == b.token_ids for a, b in zip(alone, mixed[:8], strict=True))
    same_lp = all(a.logprobs == b.logprobs for a, b in zip(alone, mixed[:8], strict=True))
    print(f"{preset}: 8 greedy requests alone vs beside 8 top-p ones: tokens equal {same_tokens}, "
          f"logprobs equal {same_lp}; compilations after warm-up "
          f"{llm.engine.runner.compilations - warm}", flush=True)
    return 0 if same_tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
