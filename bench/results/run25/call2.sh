# Run 25 call 2. The same decode steps as call 1 (b) with the sampler's two-stage top-k
# (sampling.top_k for k > 16): the full sampler with top-20 logprobs against none, alternated.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.probes.topk_probe > /tmp/topk2.log 2>&1; echo "== topk rc=$?"; grep " k 20" /tmp/topk2.log
D="--preset ouro-1.4b --rows 1,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --sampled-case --iters 20"
for arm in 20a 0a 20b 0b; do
  timeout 200 python3 -m loopjax.bench.decode_step $D --max-logprobs ${arm%?} > /tmp/step2_k$arm.log 2>&1
  echo "== step top-$arm rc=$?"; grep -E "fused" /tmp/step2_k$arm.log | cut -c1-260
done
cd /tmp && tar czf $OUT/call2.tgz topk2.log step2_k*.log
