#!/bin/bash
# Run 36 call 2 (session 29): do cuBLASLt GEMMs drop the prefill's memsets? Run 31 found ~0.8 ms
# of idle per Ouro-1.4B 4 x 512 prefill step around a `Memset 0` before each cuBLAS GEMM of
# w_gate_up and w_down. Prefill step time with XLA's default cuBLAS path against
# --xla_gpu_enable_cublaslt=true, alternating processes; then burst-32 with each.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
P="--preset ouro-1.4b --shapes 4x512,1x2048 --backend pallas --startup-backends none --iters 20"
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
p() { tag=$1 flags=$2
  XLA_FLAGS="$flags" timeout 150 python3 -m loopjax.bench.prefill $P --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -v "^W1\|cuda_timer" /tmp/$tag.log | grep -E "ms|rror" | cut -c1-200 | tail -4; }
b() { tag=$1 flags=$2
  XLA_FLAGS="$flags" timeout 110 python3 -m loopjax.bench.cli ouro-1.4b -C 32 32 32 $B --max-seconds 90 \
    --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "^burst|ready|rror" /tmp/$tag.log | cut -c1-150 | head -5; }
p pre_default ""
p pre_lt "--xla_gpu_enable_cublaslt=true"
p pre_default2 ""
p pre_lt2 "--xla_gpu_enable_cublaslt=true"
b burst_lt "--xla_gpu_enable_cublaslt=true"
b burst_default ""
