# Run 12 call 7: burst-32 Ouro-1.4B twice in one engine (first vs warm) with max 128 rows, at
# 2048- and 512-token prefill steps: is call 6's slower burst-32 the prefill size or the first run?
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 10)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-200; }
bc b_p2048 100 ouro-1.4b -C 32 32 128 --max-num-rows 128
bc b_p512 100 ouro-1.4b -C 32 32 128 --max-num-rows 128 --max-prefill-tokens 512
cd /tmp && tar czf $OUT/logs.tgz *.log
