# Run 12 call 2: where an Ouro-1.4B / Huginn-0125 decode step's time goes (3 traced steps, per
# kernel), and Ouro's products on the streaming kernel at 32 rows one shape at a time.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-170; }
ds o_trace 120 --preset ouro-1.4b --rows 8,32 --trace /tmp/trace
ds o_stream32 200 --preset ouro-1.4b --rows 32 "--streaming-rows=base;2048x2048:32;5632x2048:32;2048x2048:32,5632x2048:32;2048x11264:32;2048x6144:32"
ds h_trace 110 --preset huginn-0125 --rows 8 --trace /tmp/trace
cd /tmp && tar czf $OUT/logs.tgz *.log
for t in o_trace h_trace; do grep -B2 -A50 "^device:" /tmp/$t.log | head -120; done
