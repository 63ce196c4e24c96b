# Run 20 call 2 (tree after the host-side output changes): bursts end to end with the
# defaults: Ouro-1.4B burst-32 and burst-128, Huginn-0125 burst-8; and burst-32 with XLA's
# Triton GEMMs off (prefill's wo and w_down products are XLA Triton GEMMs, 27 and 63.5 us per
# layer application in run 19's trace; cuBLAS takes every product then).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 100 ouro-1.4b -C 32 32 32
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false bc b_ouro_cublas 110 ouro-1.4b -C 32 32 32
bc b_ouro128 100 ouro-1.4b -C 128 128 --max-num-rows 128
bc b_huginn 150 huginn-0125 -C 8 8 8
cd /tmp && tar czf $OUT/logs.tgz *.log
