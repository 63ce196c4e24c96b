#!/bin/bash
# Run 32 call 1: Ouro-2.6B (48 layers x 4 loops) at its real shapes, never measured before: the
# burst workload in-process (burst-32 twice, burst-64: warm-up time, compilations after it,
# tokens/s, TTFT, TPOT), then the fused decode step against its roofline at 1 and 32 rows
# (context 512) beside Ouro-1.4B's in the same run.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 100"
timeout 270 python3 -m loopjax.bench.cli ouro-2.6b -C 32 32 64 $B --out $OUT/burst26.json > /tmp/burst26.log 2>&1
echo "== burst26 rc=$?"; grep -v "^W1\|cuda_timer" /tmp/burst26.log | cut -c1-170 | tail -25
d() { tag=$1; limit=$2; shift 2
  timeout $limit python3 -m loopjax.bench.decode_step "$@" --iters 20 --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -v "^W1\|cuda_timer" /tmp/$tag.log | cut -c1-170 | tail -10; }
d step26 170 --preset ouro-2.6b --rows 1,32 --context 512
d step14 110 --preset ouro-1.4b --rows 1,32 --context 512
