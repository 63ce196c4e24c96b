# Run 20 call 4 (tree with the full collection at the end of warm-up): burst-128 three times in
# each of two fresh processes (is the first burst now as fast as the others?), then burst-32.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-230; }
bc b_ouro128_a 120 ouro-1.4b -C 128 128 128 --max-num-rows 128
bc b_ouro128_b 120 ouro-1.4b -C 128 128 128 --max-num-rows 128
bc b_ouro 100 ouro-1.4b -C 32 32 32
cd /tmp && tar czf $OUT/logs.tgz *.log
