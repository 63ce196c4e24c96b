#!/bin/bash
# Run 31 call 1: where a burst-32's idle device time sits. The burst's first 12 engine steps
# (8 prefill, then decode) and 6 steady decode steps traced, and a standalone 4 x 512 prefill
# step traced; each trace read by bench/probes/gap_census.py (gaps by size, by kernel pair,
# the largest, per step).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
E="--max-context-len 1024 --kv-memory-bytes 68719476736"
for from in start steady; do
  n=12; [ $from = steady ] && n=6
  timeout 200 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 128 -C 32 $E --trace-from $from \
    --trace-steps $n --keep-trace --out /tmp/prof_$from > /tmp/prof_$from.log 2>&1
  echo "== profile $from rc=$?"; grep -v "^W1\|cuda_timer" /tmp/prof_$from.log | cut -c1-170 | head -60
  python3 -m loopjax.bench.probes.gap_census /tmp/prof_$from/trace --top 20 2>&1 | tee $OUT/census_$from.txt | cut -c1-200
done
timeout 150 python3 -m loopjax.bench.prefill --preset ouro-1.4b --shapes 4x512 --backend pallas \
  --startup-backends none --iters 10 --trace /tmp/pf > /tmp/pf.log 2>&1
echo "== prefill rc=$?"; grep -v "^W1\|cuda_timer" /tmp/pf.log | grep -E "ouro|device:|gaps:" | cut -c1-170
python3 -m loopjax.bench.probes.gap_census /tmp/pf --top 20 2>&1 | tee $OUT/census_prefill.txt | cut -c1-200
cp /tmp/prof_start/profile.json $OUT/profile_start.json 2>/dev/null
