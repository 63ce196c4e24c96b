# Run 14 call 4: the Pallas KV write kernel (kernels/kv_write.py) vs XLA's scatter, prefill steps
# with it (Ouro-1.4B, Huginn-0125), and Huginn's prefill GEMM output converts under XLA flags.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.kernels --only kv_write --out $OUT/kv_write.json > /tmp/kv_write.log 2>&1
echo "== kv_write rc=$?"; grep "kv_write\|rows," /tmp/kv_write.log | cut -c1-150
pf() { tag=$1; presets=$2; shift 2
  XLA_FLAGS="$*" timeout 120 python3 -m loopjax.bench.prefill --preset $presets --shapes 4x512 --huginn-shapes 4x512 --backend pallas --startup-backends none --trace /tmp/tr_$tag --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? XLA_FLAGS=$*"; grep "scatter\|write_kv\|wrapped_convert \|wrapped_convert_\|% of peak" /tmp/$tag.log | grep -v "^|" | cut -c1-160 | head -14; }
pf p_kernel ouro-1.4b,huginn-0125 ""
pf p_h_nofallback huginn-0125 "--xla_gpu_cublas_fallback=false"
pf p_h_lt huginn-0125 "--xla_gpu_enable_cublaslt=true"
cd /tmp && tar czf $OUT/logs.tgz *.log
