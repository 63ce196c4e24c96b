# Run 25 call 4. Call 3 again after the fix of silu_mul_product's call (it lacked the new
# counters argument, so 'auto' failed at 8-32 rows): counters_check.py at 32 rows (call 3 ran
# out of time there), ops_check on 'auto', the decode step on 'auto' and 'persistent'.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
D="--preset ouro-1.4b --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto,persistent --per-loop-rows 0 --iters 20"
timeout 240 python3 -m loopjax.bench.decode_step $D > /tmp/step4.log 2>&1; echo "== step rc=$?"; grep -E "fused" /tmp/step4.log | cut -c1-250
timeout 150 python3 bench/results/run25/counters_check.py 32 > /tmp/counters4.log 2>&1; echo "== counters rc=$?"; tail -3 /tmp/counters4.log | cut -c1-400
timeout 120 python3 -m loopjax.bench.probes.ops_check --rows 8,32 --variants "matmul auto" > /tmp/ops4.log 2>&1; echo "== ops_check rc=$?"; tail -4 /tmp/ops4.log | cut -c1-300
cd /tmp && tar czf $OUT/call4.tgz counters4.log ops4.log step4.log
