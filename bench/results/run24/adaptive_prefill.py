"""Run 24: time Huginn-0125 requests with a logit exit criterion (KL, select mode) whose
prefill runs the coda on every checked loop: 4 prompts of 512 random tokens, 1 output token
each (so the call is the prefill step), on a warm engine. Prints the median of 5 calls."""
import random
import statistics
import time

import loopjax
from loopjax.llm import LLM

model = loopjax.load("huginn-0125")
llm = LLM(model, max_num_rows=8, decode_row_buckets=(8,), prefill_token_buckets=(2048,),
          max_context_len=1024, kv_memory_bytes=32 << 30, adaptive_exit=True, verbose=False)
rng = random.Random(0)
prompts = [[rng.randrange(3, model.cfg.vocab_size) for _ in range(512)] for _ in range(4)]
kw = dict(max_tokens=1, temperature=0.0, ignore_eos=True, exit_criterion="kl", exit_mode="select")
for _ in range(2):
    llm.generate(prompts, **kw)
times = []
for _ in range(5):
    start = time.perf_counter()
    outs = llm.generate(prompts, **kw)
    times.append(time.perf_counter() - start)
median, low, high = (1e3 * f(times) for f in (statistics.median, min, max))
print(f"adaptive prefill, 4 x 512, kl select: median {median:.1f} ms (min {low:.1f}, max {high:.1f}); "
      f"loops {[o.exit_loops for o in outs]}; compiles {llm.engine.stats().get('compilations')}")
