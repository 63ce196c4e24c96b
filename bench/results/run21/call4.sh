# Run 21 call 4: the session's tree against its start (8ba7129, shipped as _base/), in one call:
# burst-32 in alternated processes (new, base, new, base), then Huginn-0125 burst-8 (warm-up).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
b() { tag=$1 dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
  timeout 110 python3 -m loopjax.bench.cli "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "burst on|warm-up" /tmp/$tag.log | cut -c1-150 | head -5; }
b b32_new1 . ouro-1.4b -C 32 32 32
b b32_base1 _base ouro-1.4b -C 32 32 32
b b32_new2 . ouro-1.4b -C 32 32 32
b b32_base2 _base ouro-1.4b -C 32 32 32
b h8_new . huginn-0125 -C 8 8
b h8_base _base huginn-0125 -C 8 8
cd /tmp && tar czf $OUT/call4.tgz *.log *.json
