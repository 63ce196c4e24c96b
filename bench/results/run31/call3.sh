#!/bin/bash
# Run 31 call 3: burst-32 and burst-128 with bigger prefill steps or a bigger prefill share.
# The burst's start is P P P P D P P P P D ... today (4 x 512 per prefill step, 4 prefill steps
# per fused decode step): the decode step between the prefill batches is wall time the last
# request waits through. Arms (one process each, alternating): base (defaults), tok4096
# (--max-prefill-tokens 4096 --max-prefill-rows 8), share2 (--max-prefill-batches-before-decode 2).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 100"
b() { tag=$1; shift
  timeout 170 python3 -m loopjax.bench.cli "$@" $B --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|compil|rror" /tmp/$tag.log | cut -c1-170 | head -8; }
T4="--max-prefill-tokens 4096 --max-prefill-rows 8"
S2="--max-prefill-batches-before-decode 2"
b base_1 ouro-1.4b -C 32 32 32 128 128
b tok_1 ouro-1.4b -C 32 32 32 128 128 $T4
b share_1 ouro-1.4b -C 32 32 32 128 128 $S2
b base_2 ouro-1.4b -C 32 32 32 128 128
b tok_2 ouro-1.4b -C 32 32 32 128 128 $T4
b share_2 ouro-1.4b -C 32 32 32 128 128 $S2
b base_h huginn-0125 -C 8 8
b tok_h huginn-0125 -C 8 8 $T4
