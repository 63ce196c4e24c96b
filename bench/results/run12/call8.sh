# Run 12 call 8: the first burst after a warm-up that runs every executable once (vs call 7).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 10)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-200; }
bc b_p2048 100 ouro-1.4b -C 32 32 128 --max-num-rows 128
cd /tmp && tar czf $OUT/logs.tgz *.log
