#!/bin/bash
# Run 34 call 2 (session 27): call 1's bad_words check found a banned 3-word sequence in an
# output (the host counted this step's own token as one in flight); the same check after the fix.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python3 - <<'PY' 2>&1 | grep -v Warning | tail -20
import dataclasses, time
import loopjax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

model = loopjax.load("ouro-1.4b")
vocab = {f"w{i}": i for i in range(model.cfg.vocab_size)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece(prefix="##")
model = dataclasses.replace(model, tokenizer=tok)
engine = Engine(model, EngineConfig(max_context_len=1024, kv_memory_bytes=64 << 30, verbose=False))
compiled = engine.stats()["compilations"]
prompts = {f"r{i}": [(37 * i + 11 * j) % 40000 + 100 for j in range(500 + i)] for i in range(32)}

def run(tag, words=None):
    t = time.perf_counter()
    for rid, p in prompts.items():
        kw = {} if words is None else {"bad_words": words[rid]}
        engine.add_request(p, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, **kw), tag + rid)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id[len(tag):], list(o.token_ids)) for o in engine.step() if o.finished)
    return done, time.perf_counter() - t

plain, t_plain = run("a")
words, banned = {}, {}
for rid, out in plain.items():  # ban the 2-word and 3-word sequences ending at tokens 20 and 60
    banned[rid] = [tuple(out[19:21]), tuple(out[57:60])]
    words[rid] = [" ".join(f"w{t}" for t in seq) for seq in banned[rid]]
got, t_bad = run("b", words)
bad = [(rid, s) for rid, g in got.items() for s in banned[rid] for i in range(len(g)) if tuple(g[i:i + len(s)]) == s]
ok = not bad
first = [next(i for i in range(128) if got[r][i] != plain[r][i]) for r in plain]
print(f"bad_words: 32 greedy requests, P~500, O=128: plain {t_plain:.2f} s, with 2 bad words each "
      f"{t_bad:.2f} s; no banned sequence in any output: {ok}; first difference at token "
      f"min {min(first)} max {max(first)} (the first ban ends at token 20 or earlier); found: {bad[:3]}")
print(f"compilations after warm-up: {engine.stats()['compilations'] - compiled}")
PY
echo "== bad_words rc=$?"
