#!/bin/bash
# Run 34 call 1 (session 27): (a) the session's tree against its start (2dade05, shipped as
# _base/ and installed in turn): the fused decode step at 1 / 32 rows (the sampler's masks
# grew from [R, 8] to [R, 64, 2] for bad_words), burst-32 Ouro-1.4B and burst-8 Huginn-0125
# in-process, alternating processes; (b) bad_words on the H200: Ouro-1.4B (seeded random
# weights) with a word-level tokenizer, 32 greedy requests with and without bad words.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
S="--backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20 --context 512 --preset ouro-1.4b --rows 1,32"
inst() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
b() { tag=$1 dir=$2 secs=$3; shift 3
  inst $dir && (cd $dir && timeout $((secs + 20)) python3 -m loopjax.bench.cli "$@" $B --max-seconds $secs \
    --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|rror" /tmp/$tag.log | cut -c1-170 | head -5; }
d() { tag=$1 dir=$2
  inst $dir && (cd $dir && timeout 200 python3 -m loopjax.bench.decode_step $S --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -v "^W1\|cuda_timer" /tmp/$tag.log | cut -c1-190 | tail -6; }
d step_new .
d step_base _base
b new_1 . 60 ouro-1.4b -C 32 32 32
b base_1 _base 60 ouro-1.4b -C 32 32 32
b new_2 . 60 ouro-1.4b -C 32 32 32
b base_2 _base 60 ouro-1.4b -C 32 32 32
b new_h . 150 huginn-0125 -C 8
b base_h _base 150 huginn-0125 -C 8
inst .
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
ok = all(all(tuple(g[i:i + len(s)]) != s for s in banned[rid] for i in range(len(g))) for rid, g in got.items())
first = [next(i for i in range(128) if got[r][i] != plain[r][i]) for r in plain]
print(f"bad_words: 32 greedy requests, P~500, O=128: plain {t_plain:.2f} s, with 2 bad words each "
      f"{t_bad:.2f} s; no banned sequence in any output: {ok}; first difference at token "
      f"min {min(first)} max {max(first)} (the first ban ends at token 20 or earlier)")
print(f"compilations after warm-up: {engine.stats()['compilations'] - compiled}")
PY
echo "== bad_words rc=$?"
