# Run 18 call 3: matmul 'auto' with Ouro's qkv + RoPE on the Mosaic kernel at 8-64 rows
# (matmul_ops.MOSAIC_ROPE_ROWS, now the default) against the Triton kernel ('none') in the
# Ouro-1.4B decode step; one Ouro loop on each Ops against XLA's; burst-32 end to end.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 1,8,32 > /tmp/ops.log 2>&1
echo "ops rc=$?"; grep "rows\|rror" /tmp/ops.log | cut -c1-200
timeout 240 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rope-rows 'none;base' --per-loop-rows 0 --context 512 --rows 8,16,32,64 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-230
timeout 120 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rope-rows 'base;none' --per-loop-rows 0 --context 2048 --rows 32 --iters 20 --out $OUT/steps2048.json > /tmp/steps2048.log 2>&1
echo "steps2048 rc=$?"; grep " rows \|rror" /tmp/steps2048.log | cut -c1-230
timeout 90 python3 -m loopjax.bench.cli ouro-1.4b -C 32 32 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 70 --out $OUT/b_ouro.json > /tmp/b_ouro.log 2>&1
echo "b_ouro rc=$?"; grep "burst on\|engine ready" /tmp/b_ouro.log | cut -c1-260
cd /tmp && tar czf $OUT/logs.tgz ops.log steps.log steps2048.log b_ouro.log
