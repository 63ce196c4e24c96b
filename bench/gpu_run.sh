#!/usr/bin/env bash
# One device call: install loopjax from the checkout (no network there) and run the named
# benchmarks, each under its own time limit, logs and JSON under $OUT.
#   bash bench/gpu_run.sh kernels:150 matmul:150 decode_ouro:200
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
for spec in "$@"; do
  name=${spec%%:*}; limit=${spec##*:}
  case $name in
    kernels) cmd="python3 -m loopjax.bench.kernels --out $OUT/kernels.json" ;;
    pointwise) cmd="python3 -m loopjax.bench.kernels --only pointwise --seeds 6 --out $OUT/pointwise.json" ;;
    attn_decode) cmd="python3 -m loopjax.bench.kernels --only decode --budget $((limit - 30)) --out $OUT/attn_decode.json" ;;
    attn_sweep) cmd="python3 -m loopjax.bench.kernels --only sweep --budget $((limit - 30)) --out $OUT/attn_sweep.json" ;;
    matmul) cmd="python3 -m loopjax.bench.matmul --max-seconds $((limit - 30))" ;;
    matmul_rope) cmd="python3 -m loopjax.bench.matmul_rope" ;;
    decode_ouro) cmd="python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 1,8,32,128 --context 512,2048 --backend xla --matmul xla,streaming --per-loop-rows 1,32 --out $OUT/decode_ouro.json" ;;
    decode_huginn) cmd="python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,8,32 --context 512 --backend xla --matmul xla,streaming --per-loop-rows 1 --out $OUT/decode_huginn.json" ;;
    burst_ouro) cmd="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 128 --max-num-rows 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --max-seconds $((limit - 20)) --no-progress --out $OUT/burst_ouro.json" ;;
    burst_huginn) cmd="python3 -m loopjax.bench.cli huginn-0125 --workload burst -P 512 -O 128 -C 8 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --max-seconds $((limit - 20)) --no-progress --out $OUT/burst_huginn.json" ;;
    sessions_ouro) cmd="python3 -m loopjax.bench.cli ouro-1.4b --workload sessions -N 64 -T 6 -P 512 -O 128 -U 64 --compare-prefix-cache --max-context-len 2048 --kv-memory-bytes 85899345920 --max-seconds $((limit - 20)) --no-progress --out $OUT/sessions_ouro.json" ;;
    sessions_huginn) cmd="python3 -m loopjax.bench.cli huginn-0125 --workload sessions -N 32 -T 4 -P 256 -O 32 -U 32 --compare-prefix-cache --max-context-len 512 --kv-memory-bytes 51539607552 --decode-row-buckets 8 16 32 --prefill-token-buckets 128 256 512 --max-seconds $((limit - 20)) --no-progress --out $OUT/sessions_huginn.json" ;;
    adaptive_huginn) cmd="python3 -m loopjax.bench.adaptive --preset huginn-0125 --max-seconds $((limit - 20)) --out $OUT/adaptive_huginn.json" ;;
    adaptive_ouro) cmd="python3 -m loopjax.bench.adaptive --preset ouro-1.4b --max-seconds $((limit - 20)) --out $OUT/adaptive_ouro.json" ;;
    prefill_ouro) cmd="python3 -m loopjax.bench.prefill --preset ouro-1.4b --max-seconds $((limit - 20)) --out $OUT/prefill_ouro.json" ;;
    burst32_ouro) cmd="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --max-seconds $((limit - 20)) --no-progress --out $OUT/burst32_ouro.json" ;;
    profile_ouro) cmd="python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 64 -C 32 --max-num-rows 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --trace-steps 10 --out $OUT/profile_ouro" ;;
    profile_huginn) cmd="python3 -m loopjax.bench.profile huginn-0125 -P 512 -O 32 -C 8 --max-context-len 1024 --kv-memory-bytes 68719476736 --trace-steps 6 --out $OUT/profile_huginn" ;;
    decode_width_ouro) cmd="python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 32 --context 576 --backend xla,pallas --per-loop-rows 0 --page-width 576,1024 --out $OUT/decode_width_ouro.json" ;;
    decode_mgpu_ouro) cmd="python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 32 --context 1024,4096 --backend pallas,pallas_mgpu,xla --per-loop-rows 0 --out $OUT/decode_mgpu_ouro.json" ;;
    decode_mgpu_huginn) cmd="python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 32 --context 1024 --backend pallas,pallas_mgpu,xla --per-loop-rows 0 --out $OUT/decode_mgpu_huginn.json" ;;
    burst32_ouro_shared) cmd="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --kv-layout shared --max-seconds $((limit - 20)) --no-progress --out $OUT/burst32_ouro_shared.json" ;;
    burst32_ouro_sync) cmd="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-async-scheduling --max-seconds $((limit - 20)) --no-progress --out $OUT/burst32_ouro_sync.json" ;;
    attn_write_check) cmd="python3 -m loopjax.bench.probes.attn_write_check" ;;
    sort_probe) cmd="python3 -m loopjax.bench.probes.sort_probe" ;;
    ops_check) cmd="python3 -m loopjax.bench.probes.ops_check --rows 1,8" ;;
    steps_ouro) cmd="python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20 --out $OUT/steps_ouro.json" ;;
    steps_huginn) cmd="python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --out $OUT/steps_huginn.json" ;;
    *) echo "unknown benchmark $name"; continue ;;
  esac
  echo "=== $name (limit ${limit}s): $cmd"
  start=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" $cmd >"$OUT/$name.log" 2>&1
  echo "rc=$? in $(( $(date +%s) - start ))s"
  tail -n 60 "$OUT/$name.log"
done
