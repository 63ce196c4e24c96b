# Run 13 call 5: with the fused norms, the 1-row step's attention splits (its combine kernels
# now weigh more), and streaming Ouro-1.4B's products at 64 and 128 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | sed 's/ouro-1.4b pallas_mgpu      auto    xla    fused//' | cut -c1-200; }
ds o_splits1 120 --rows 1 --context 512,2048 --attn-splits auto,1,2,4
ds o_stream64 150 --rows 64,128 --context 512 "--streaming-rows=base;2048x2048:128,5632x2048:128,2048x6144:128,2048x11264:128;2048x2048:128,5632x2048:128"
cd /tmp && tar czf $OUT/logs.tgz *.log
