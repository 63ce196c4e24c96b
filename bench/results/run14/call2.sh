# Run 14 call 2: where the time goes in the two halves of burst-32: a 4 x 512 prefill step
# (pallas attention, as the engine's default on a GPU) and a 32-row decode step (context 512).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.prefill --preset ouro-1.4b --shapes 4x512,1x2048 --backend pallas --startup-backends none --trace /tmp/ptrace --out $OUT/p_trace.json > /tmp/p_trace.log 2>&1
echo "== p_trace rc=$?"; grep -v "^\s*$" /tmp/p_trace.log | cut -c1-180 | head -120
timeout 120 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 32 --iters 20 --trace /tmp/dtrace --out $OUT/o_trace32.json > /tmp/o_trace32.log 2>&1
echo "== o_trace32 rc=$?"; grep -v "^\s*$" /tmp/o_trace32.log | cut -c1-180 | head -80
cd /tmp && tar czf $OUT/logs.tgz *.log
