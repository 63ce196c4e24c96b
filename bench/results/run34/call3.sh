#!/bin/bash
# Run 34 call 3 (session 27): call 1's burst-32 means differed by 0.7% (new 2,950.1, base 2,969.8):
# three more alternating processes per tree, the new tree with the bad_words fix of call 2.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
inst() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
b() { tag=$1 dir=$2 secs=$3; shift 3
  inst $dir && (cd $dir && timeout $((secs + 20)) python3 -m loopjax.bench.cli "$@" $B --max-seconds $secs \
    --out /tmp/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|rror" /tmp/$tag.log | cut -c1-170 | head -5; }
for i in 3 4 5; do
  b base_$i _base 60 ouro-1.4b -C 32 32 32
  b new_$i . 60 ouro-1.4b -C 32 32 32
done
