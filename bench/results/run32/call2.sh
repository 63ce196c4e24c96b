#!/bin/bash
# Run 32 call 2: call 1's decode steps ran decode_step's XLA defaults; here the engine's (the
# Mosaic attention, matmul 'auto'): Ouro-2.6B at 1 / 8 / 32 rows and Ouro-1.4B at 1 / 32 rows,
# context 512, fused steps only.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S="--backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20 --context 512"
d() { tag=$1; limit=$2; shift 2
  timeout $limit python3 -m loopjax.bench.decode_step $S "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -v "^W1\|cuda_timer" /tmp/$tag.log | cut -c1-190 | tail -10; }
d step26 300 --preset ouro-2.6b --rows 1,8,32
d step14 200 --preset ouro-1.4b --rows 1,32
