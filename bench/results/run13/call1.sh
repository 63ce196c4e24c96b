# Run 13 call 1 (session 6): Huginn-0125's first burst with warm-up runs; Ouro-1.4B kernels per
# step at 1 and 32 rows (trace); the Mosaic attention's context splits at 16 and 64 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
echo "commit $(git rev-parse --short HEAD 2>/dev/null)"
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-200; }
ds o_trace 110 --preset ouro-1.4b --rows 1,32 --context 512 --trace /tmp/trace
ds o_splits 150 --preset ouro-1.4b --rows 16,64 --context 512,2048 --attn-splits auto,1,2
timeout 150 python3 -m loopjax.bench.cli huginn-0125 --workload burst -P 512 -O 128 -C 8 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 130 --out $OUT/b_huginn.json > /tmp/b_huginn.log 2>&1
echo "== b_huginn rc=$?"; grep "burst on\|engine ready\|slowest\|compil" /tmp/b_huginn.log | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz *.log
grep -B2 -A40 "^device:" /tmp/o_trace.log | head -100
