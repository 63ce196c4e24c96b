# Run 25 call 1. What max_logprobs = 20 (the new default) costs: (a) lax.top_k over [R, V]
# logits alone (bench/probes/topk_probe.py); (b) the Ouro-1.4B decode step's full sampler
# (every row drawing) with top-20 logprobs against none, and the greedy step (which computes
# none in either); (c) burst-32 greedy on the new tree against the tree before it (HEAD
# 6075635 shipped as _base/: max_logprobs 0 there), each arm installed and run in its own process.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.probes.topk_probe > /tmp/topk.log 2>&1; echo "== topk rc=$?"; cat /tmp/topk.log
D="--preset ouro-1.4b --rows 1,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --sampled-case --iters 20"
for arm in 0a 20a 0b 20b; do
  timeout 200 python3 -m loopjax.bench.decode_step $D --max-logprobs ${arm%?} > /tmp/step_k$arm.log 2>&1
  echo "== step top-$arm rc=$?"; grep -E "fused" /tmp/step_k$arm.log | cut -c1-260
done
B="ouro-1.4b --workload burst -P 512 -O 128 -C 32 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
bu() { tag=$1 dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -m loopjax.bench.cli $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "engine ready|burst on" /tmp/$tag.log | cut -c1-260; }
bu burst_new1 .
bu burst_base1 _base
bu burst_new2 .
bu burst_base2 _base
cd /tmp && tar czf $OUT/call1.tgz topk.log step_k*.log burst_*
