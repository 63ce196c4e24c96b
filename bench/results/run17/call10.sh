# Run 17 call 10: matmul 'persistent' with the norms in the kernel (phase 3; no norm_add_norm kernel)
# against 'auto' in the Ouro-1.4B decode step (1/8/32 rows, context 512
# and 32 rows at 2048), and one Ouro loop at the real shapes on each Ops against XLA's.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 1,8,32 > /tmp/ops.log 2>&1
echo "ops rc=$?"; grep "rows\|rror" /tmp/ops.log | cut -c1-200
timeout 220 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto,persistent --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-200
timeout 120 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul persistent,auto --per-loop-rows 0 --context 2048 --rows 32 --iters 20 --out $OUT/steps2048.json > /tmp/steps2048.log 2>&1
echo "steps2048 rc=$?"; grep " rows \|rror" /tmp/steps2048.log | cut -c1-200
cd /tmp && tar czf $OUT/logs.tgz ops.log steps.log steps2048.log
