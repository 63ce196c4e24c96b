"""Run 24 call 3: loopjax.score at the real shapes (seeded random bf16 weights): the first call
of a bucket (compile included) and the next ones, tokens scored per second, and the device's
peak memory; Ouro-1.4B at 512 and 2,048 tokens, Huginn-0125 (32 loops) at 512 and 2,048."""
import random
import time

import jax

import loopjax


def peak_gb():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9


for preset in ("ouro-1.4b", "huginn-0125"):
    model = loopjax.load(preset)
    rng = random.Random(0)
    for length in (512, 2048):
        seqs = [[rng.randrange(3, model.cfg.vocab_size) for _ in range(length)] for _ in range(4)]
        start = time.perf_counter()
        first = loopjax.score(model, seqs[:1], top_k=1)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        outs = loopjax.score(model, seqs, top_k=1)
        warm = (time.perf_counter() - start) / len(seqs)
        assert outs[0].token_logprobs == first[0].token_logprobs  # deterministic
        mean_lp = sum(sum(o.token_logprobs) for o in outs) / sum(len(o.token_logprobs) for o in outs)
        print(f"{preset:12s} {length:5d} tokens: first call {cold:6.1f} s, then {1e3 * warm:8.1f} ms "
              f"per sequence ({length / warm:9.0f} tok/s); mean log p {mean_lp:.3f}; "
              f"peak {peak_gb():.1f} GB", flush=True)
    del model
