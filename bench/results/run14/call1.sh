# Run 14 call 1: does XLA's programmatic dependent launch (xla_gpu_enable_pdl, found in
# jaxlib's flag strings) shorten the Ouro-1.4B decode step? Same process settings otherwise.
# Also: a single Ouro stream after the numpy-batch change (make_batch no longer device_puts).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
steps() { tag=$1; shift
  XLA_FLAGS="$*" timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 20 --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? XLA_FLAGS=$*"; grep " rows \|rror\|nknown" /tmp/$tag.log | cut -c1-200 | head -8; }
steps o_base ""
steps o_pdl "--xla_gpu_enable_pdl=true"
steps o_pdl_launch "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
steps o_nopdl "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"
timeout 80 python3 -m loopjax.bench.cli ouro-1.4b -C 1 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60 --out $OUT/b_ouro1.json > /tmp/b_ouro1.log 2>&1
echo "== b_ouro1 rc=$?"; grep "burst on\|engine ready" /tmp/b_ouro1.log | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz *.log
