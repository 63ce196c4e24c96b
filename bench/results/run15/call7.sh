# Run 15 call 7 (tree: branch huginn-qkv-rope, ffe9a6a; not merged): Huginn-0125's qkv product
# with qk_bias and the interleaved RoPE in its epilogue (kernels/streaming_matmul_rope.py there):
# bitwise check on the GPU (bench/probes/qkv_rope_check.py there), steps against 5f3339a (main,
# shipped as _base/), burst-8 end to end.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
steps() { tag=$1
  timeout 110 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 10 --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows \|rror" /tmp/$tag.log | cut -c1-230; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 110 python3 -m loopjax.bench.probes.qkv_rope_check > /tmp/qkv_rope_check.log 2>&1
echo "== qkv_rope_check rc=$?"; grep -v "^\s*$" /tmp/qkv_rope_check.log | cut -c1-220 | tail -8
steps h_new
timeout 100 python3 -m loopjax.bench.cli huginn-0125 --workload burst -P 512 -O 128 -C 8 8 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 80 --out $OUT/b_huginn.json > /tmp/b_huginn.log 2>&1
echo "== b_huginn rc=$?"; grep "burst on\|engine ready" /tmp/b_huginn.log | cut -c1-260
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && steps h_base)
cd /tmp && tar czf $OUT/logs.tgz *.log
