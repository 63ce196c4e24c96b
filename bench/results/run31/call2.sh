#!/bin/bash
# Run 31 call 2: XLA's autotuner picks cuBLAS (nvjet) for the prefill's w_gate_up and w_down,
# and each of those GEMMs comes with a Memset and ~2.7 us of idle around it (call 1). Does a
# Triton-only choice (--xla_gpu_cublas_fallback=false) make the prefill step faster? Arms
# alternate, one process each; the flagged arm traced once to see the kernels.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
P="--preset ouro-1.4b,huginn-0125 --shapes 4x512,1x2048 --huginn-shapes 4x512 --backend pallas --startup-backends none --iters 20"
for arm in base triton base triton; do
  flags=""; [ $arm = triton ] && flags="--xla_gpu_cublas_fallback=false"
  XLA_FLAGS="$flags" timeout 170 python3 -m loopjax.bench.prefill $P > /tmp/pf_$arm.log 2>&1
  echo "== $arm rc=$?"; grep -E "^ *(ouro|huginn).*ms " /tmp/pf_$arm.log | cut -c1-170
done
XLA_FLAGS="--xla_gpu_cublas_fallback=false" timeout 170 python3 -m loopjax.bench.prefill --preset ouro-1.4b \
  --shapes 4x512 --backend pallas --startup-backends none --iters 5 --trace /tmp/tr > /tmp/tr.log 2>&1
echo "== traced triton rc=$?"; grep -v "^W1\|cuda_timer" /tmp/tr.log | head -24 | cut -c1-150
python3 -m loopjax.bench.probes.gap_census /tmp/tr --top 8 | sed -n 1,20p | cut -c1-160
