# Run 16 call 9 (tree with the session's defaults): end-to-end spread, Ouro-1.4B burst-32 x2
# and Huginn-0125 burst-8 x2 on one engine each.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 80 ouro-1.4b -C 32 32
bc b_huginn 120 huginn-0125 -C 8 8
cd /tmp && tar czf $OUT/logs.tgz *.log
