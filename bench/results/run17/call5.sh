# Run 17 call 5: XLA's two PDL switches together (its kernels then wait and trigger early, so a
# `uses_pdl` Mosaic kernel after them may start early): the chains (traced) and the decode step.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
PDL="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
for flags in "" "$PDL"; do
  echo "== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout 200 python3 -m loopjax.bench.probes.pdl_chain --rows 1,32 --trace /tmp/trc --arms triton,pdl_off@n128,pdl@n128 > /tmp/chain.log 2>&1; echo "rc=$?"
  grep -v Warning /tmp/chain.log | grep "µs/layer\|^device\|^gaps" | cut -c1-160
  XLA_FLAGS="$flags" timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,32 --iters 20 > /tmp/step.log 2>&1
  echo "step rc=$?"; grep " rows " /tmp/step.log | cut -c1-200
done
