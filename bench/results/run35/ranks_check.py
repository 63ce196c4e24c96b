"""Run 35: ranks and logprobs of 32 mixed requests (8 greedy, 24 drawn; top_k 50 / min_p 0.02
mixed), 5 top logprobs each, checked against the rule: a token listed among its top logprobs
ranks at its place there, an unlisted one below them all, a greedy one first; and 0
compilations after warm-up. Usage: python ranks_check.py PRESET PROMPT_LEN MAX_CONTEXT KV_GIB."""
import sys

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

preset, prompt_len, max_context, kv_gib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = loopjax.load(preset)
engine = Engine(model, EngineConfig(max_context_len=max_context, kv_memory_bytes=kv_gib << 30, verbose=False))
compiled = engine.stats()["compilations"]
vocab = model.cfg.vocab_size
for i in range(32):
    prompt = [(37 * i + 11 * j) % (vocab - 100) + 50 for j in range(prompt_len + i)]
    params = SamplingParams(max_tokens=64, temperature=0.0 if i % 4 == 0 else 1.0, top_k=50 if i % 2 else 0,
                            min_p=0.02 if i % 3 == 0 else 0.0, seed=i, logprobs=5, ignore_eos=True)
    engine.add_request(prompt, params, f"r{i}")
done = {}
while engine.has_unfinished():
    done.update((o.request_id, o) for o in engine.step() if o.finished)
bad, listed, total = [], 0, 0
for rid, o in done.items():
    greedy = int(rid[1:]) % 4 == 0
    for k, (tok, rank, top) in enumerate(zip(o.token_ids, o.ranks, o.top_logprobs)):
        total += 1
        ids = [t for t, _ in top]
        listed += tok in ids
        want_ok = rank == ids.index(tok) + 1 if tok in ids else rank > len(ids)
        if not want_ok or (greedy and rank != 1):
            bad.append((rid, k, tok, rank, ids))
print(f"ranks: {total} tokens of {len(done)} requests, {listed} listed among their top 5; "
      f"violations: {len(bad)} {bad[:3]}")
print(f"compilations after warm-up: {engine.stats()['compilations'] - compiled}")
