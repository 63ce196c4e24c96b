# Run 21 call 5: call 4's base arms failed (run from the checkout's root, `python -m` imported
# the new tree's loopjax/ beside _base's kernels/). The same machine, again with each arm run
# from its own tree: burst-32 base, new, base; Huginn-0125 burst-8 base.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
ROOT=$PWD
b() { tag=$1 dir=$2; shift 2
  cd $ROOT/$dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
  timeout 110 python3 -m loopjax.bench.cli "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "burst on|warm-up" /tmp/$tag.log | cut -c1-150 | head -5; cd $ROOT; }
b b32_base3 _base ouro-1.4b -C 32 32 32
b b32_new3 . ouro-1.4b -C 32 32 32
b b32_base4 _base ouro-1.4b -C 32 32 32
b h8_base2 _base huginn-0125 -C 8 8
cd /tmp && tar czf $OUT/call5.tgz b32_base3.* b32_new3.* b32_base4.* h8_base2.*
