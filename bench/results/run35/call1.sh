#!/bin/bash
# Run 35 call 1 (session 28): the session's tree against its start (aee2f80, shipped as _base/
# and installed in turn). The sampler now also computes the chosen token's vLLM rank and runs
# min-p before top-k / top-p: (a) the fused decode step at 1 / 32 rows; (b) ranks and logprobs
# on the H200 (ranks_check.py). Call 2: burst-32 Ouro-1.4B, greedy and drawn.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
SAMPLED="--temperature 0.8 --top-p 0.95 --min-p 0.05 --sampling-seed 7"
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
inst .
timeout 200 python3 bench/results/run35/ranks_check.py ouro-1.4b 500 1024 64 2>&1 | grep -v Warning | tail -5
echo "== ranks rc=$?"
