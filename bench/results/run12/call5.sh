# Run 12 call 5: context splits of the Mosaic decode attention in the step (1 and 8 rows, both
# models); burst-32 Ouro-1.4B with larger prefill steps.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-200; }
ds o_splits 140 --preset ouro-1.4b --rows 1,8 --iters 20 --attn-splits auto,1,2
ds o_splits2k 80 --preset ouro-1.4b --rows 1,8 --context 2048 --iters 20 --attn-splits auto,1
ds h_splits 100 --preset huginn-0125 --rows 1,8 --attn-splits auto,1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-250; }
bc b_p1024 70 ouro-1.4b -C 32 --max-prefill-tokens 1024
bc b_p2048 70 ouro-1.4b -C 32 --max-prefill-tokens 2048
cd /tmp && tar czf $OUT/logs.tgz *.log
