#!/bin/bash
# Run 32 call 4: Huginn-0125 burst-8 of the final tree and of 33a6158 (_base/) again: call 3's
# were cut by their --max-seconds 60 (the warm-up took 51-53 s of it).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 150"
b() { tag=$1 dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 200 python3 -m loopjax.bench.cli "$@" $B --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|rror" /tmp/$tag.log | cut -c1-170 | head -5; }
b new_h . huginn-0125 -C 8 8
b base_h _base huginn-0125 -C 8 8
