# Run 18 call 4: the MLP's products and the norms' partials on Mosaic kernels too (SiLU*up on
# persistent_mlp's phase 1 alone; wo / w_down swapped split-K partials into the norms kernel):
# one Ouro loop at the real shapes against XLA's, then the Ouro-1.4B decode step (context
# 512) with each set of Mosaic ops; 'base' (qkv only) first and last, to see the order bias.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.probes.ops_check --rows 8,32 > /tmp/ops.log 2>&1
echo "ops rc=$?"; grep "rows\|rror" /tmp/ops.log | cut -c1-200
R=8,16,32,64
timeout 330 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rows "base;qkv=$R+silu=$R;qkv=$R+norms=$R;qkv=$R+silu=$R+norms=$R;base" --per-loop-rows 0 --context 512 --rows 8,16,32 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz ops.log steps.log
