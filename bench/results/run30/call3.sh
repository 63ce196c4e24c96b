#!/bin/bash
# Run 30 call 3: the session's host changes (engine step reads before it pops, the dropped-plan
# path, the checks moved before the engine build, generation_config EOS ids) end to end on the
# GPU: burst-32 Ouro-1.4B and burst-8 Huginn-0125 in-process, this tree against d9849ed (in
# _base/, installed in turn), alternating processes.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
b() { tag=$1 dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 150 python3 -m loopjax.bench.cli "$@" $B --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|compil" /tmp/$tag.log | cut -c1-170 | head -6; }
b new_1 . ouro-1.4b -C 32 32 32
b base_1 _base ouro-1.4b -C 32 32 32
b new_2 . ouro-1.4b -C 32 32 32
b base_2 _base ouro-1.4b -C 32 32 32
b new_h . huginn-0125 -C 8 8 8
b base_h _base huginn-0125 -C 8 8 8
