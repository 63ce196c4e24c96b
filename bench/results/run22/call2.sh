# Run 22 call 2 (tree 5e79d7f): end to end, after call 1 on the same machine.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
b() { tag=$1; shift
  timeout 120 python3 -m loopjax.bench.cli "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|compil" /tmp/$tag.log | cut -c1-170 | head -6; }
b b32_2 ouro-1.4b -C 32 32 32
b b128 ouro-1.4b -C 128 128 --max-num-rows 128
b huginn8 huginn-0125 -C 8 8 8
cd /tmp && tar czf $OUT/call2.tgz b32_2.* b128.* huginn8.*
