#!/bin/bash
# Run 34 call 4 (session 27): did a one-token K/V scatter copy the pool on the GPU too? (On CPU
# XLA rewrote it as a dynamic-update-slice and copied each layer's pool around it: 613abb6.)
# The XLA attention path (XLA's write and attention; the default Mosaic kernel writes in-kernel)
# at 1 row, the tree against its start.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
S="--backend xla --matmul auto --per-loop-rows 0 --iters 20 --context 512 --preset ouro-1.4b --rows 1"
d() { tag=$1 dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 150 python3 -m loopjax.bench.decode_step $S --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -v "^W1\|cuda_timer" /tmp/$tag.log | cut -c1-190 | tail -3; }
d xla_new .
d xla_base _base
