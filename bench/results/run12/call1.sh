# Run 12 call 1: identity compile options vs run 11; pointwise kernels in the step; PDL and
# command-buffer XLA flags on the Ouro-1.4B / Huginn-0125 decode step.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.kernels --only pointwise --seeds 3 --out $OUT/pointwise.json > /tmp/pointwise.log 2>&1; echo "pointwise rc=$?"; grep -v xla_ref /tmp/pointwise.log | tail -14
ds() { tag=$1; lim=$2; flags=$3; shift 3
  XLA_FLAGS="$flags" timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? flags=[$flags] $*"; grep " rows " /tmp/$tag.log | cut -c1-150; }
ds o_base 130 "" --preset ouro-1.4b --rows 8,32 --pointwise xla,pallas
ds o_pdl 80 "--xla_gpu_enable_pdl=true" --preset ouro-1.4b --rows 8,32
ds o_pdl_launch 80 "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" --preset ouro-1.4b --rows 8,32
ds o_cmdbuf 80 "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" --preset ouro-1.4b --rows 8,32
ds h_base 80 "" --preset huginn-0125 --rows 8
ds h_pdl 80 "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" --preset huginn-0125 --rows 8
cd /tmp && tar czf $OUT/logs.tgz *.log
