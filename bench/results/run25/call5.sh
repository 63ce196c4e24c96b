# Run 25 call 5. Call 4 with the signal fixed: one release fence then relaxed adds (call 4's
# release add per counter fenced 32 times per program). The decode step on 'auto' and
# 'persistent', then counters_check.py at 1 and 32 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
D="--preset ouro-1.4b --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto,persistent --per-loop-rows 0 --iters 20"
timeout 240 python3 -m loopjax.bench.decode_step $D > /tmp/step5.log 2>&1; echo "== step rc=$?"; grep -E "fused" /tmp/step5.log | cut -c1-250
timeout 200 python3 bench/results/run25/counters_check.py 1 32 > /tmp/counters5.log 2>&1; echo "== counters rc=$?"; tail -3 /tmp/counters5.log | cut -c1-400
cd /tmp && tar czf $OUT/call5.tgz counters5.log step5.log
