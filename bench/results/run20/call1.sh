# Run 20 call 1: is `pointwise='pallas'` bitwise at decode row counts? The pointwise kernels
# alone against their XLA twins at 1 / 8 / 32 tokens (4 input draws), then one Ouro-1.4B loop
# at 8 rows (ops_check's 'pointwise pallas' variant: 9,134 of 16,384 elements differed in run
# 13) over the first layer and over all 24, and again with XLA's Triton GEMMs off (cuBLAS for
# every product), to see whether the products' configurations differ between the executables.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.kernels --only pointwise --tokens 1,8,32 --seeds 4 --out $OUT/pointwise.json > /tmp/pointwise.log 2>&1
echo "pointwise rc=$?"; grep -v "xla_ref" /tmp/pointwise.log | cut -c1-120 | tail -80
oc() { tag=$1; shift
  timeout 120 python3 -m loopjax.bench.probes.ops_check --rows 1,8,32 --variants "pointwise pallas,matmul auto" "$@" > /tmp/ops_$tag.log 2>&1
  echo "== ops $tag rc=$? $*"; grep "rows\|FAILED\|Error" /tmp/ops_$tag.log | cut -c1-160 | tail -8; }
oc l1 --num-layers 1
oc l24
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false oc l1_cublas --num-layers 1
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false oc l24_cublas
cd /tmp && tar czf $OUT/logs.tgz *.log
