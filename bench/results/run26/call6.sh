# Run 26 call 6 (tree 9e2c358 + the L2 probe): are Mosaic GPU custom calls captured into XLA's
# command buffers when CUSTOM_CALL is among --xla_gpu_enable_command_buffer's types? The
# probe's chain with an empty Mosaic kernel per product (call 5: one gap per kernel), then
# the Ouro-1.4B decode step (5 Mosaic kernels per layer application), per XLA_FLAGS setting.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
FLAGS=("" "--xla_gpu_enable_command_buffer=+CUSTOM_CALL" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL")
for i in 0 1 2; do
  echo "== probe flags '${FLAGS[$i]}'"
  XLA_FLAGS="${FLAGS[$i]}" timeout 150 python3 -m loopjax.bench.probes.l2_prefetch_probe --rows 1,32 --programs 16 --trace /tmp/cb$i > $OUT/cb_probe$i.txt 2>&1
  echo "rc=$?"; grep -E "^rows|gaps:|rror" $OUT/cb_probe$i.txt | cut -c1-160
done
D="--preset ouro-1.4b --rows 1,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20"
for i in 0 1 2 0; do
  echo "== step flags '${FLAGS[$i]}'"
  XLA_FLAGS="${FLAGS[$i]}" timeout 200 python3 -m loopjax.bench.decode_step $D > $OUT/cb_step$i.txt 2>&1
  echo "rc=$?"; grep -E "fused|rror" $OUT/cb_step$i.txt | cut -c1-220
done
