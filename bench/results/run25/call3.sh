# Run 25 call 3. The persistent MLP kernel (matmul='persistent', experimental) with its programs
# synchronizing through one counters Ref per loop instead of Pallas's global semaphores (which
# jax zero-fills before every call): (a) counters_check.py (correctness, counters back to zero,
# shared vs per-call Ref); (b) ops_check, one Ouro-1.4B loop on 'auto' and 'persistent' against
# XLA's ops; (c) the decode step on 'auto' and 'persistent', twice.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python3 bench/results/run25/counters_check.py > /tmp/counters.log 2>&1; echo "== counters rc=$?"; tail -5 /tmp/counters.log | cut -c1-400
timeout 200 python3 -m loopjax.bench.probes.ops_check --rows 1,8,32 --variants "matmul auto,matmul persistent" > /tmp/ops.log 2>&1; echo "== ops_check rc=$?"; tail -8 /tmp/ops.log | cut -c1-300
D="--preset ouro-1.4b --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto,persistent --per-loop-rows 0 --iters 20"
for arm in a b; do
  timeout 240 python3 -m loopjax.bench.decode_step $D > /tmp/step3_$arm.log 2>&1
  echo "== step $arm rc=$?"; grep -E "fused" /tmp/step3_$arm.log | cut -c1-250
done
cd /tmp && tar czf $OUT/call3.tgz counters.log ops.log step3_*.log
