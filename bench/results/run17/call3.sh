# Run 17 call 3: the PDL kernel with wgmma kept in flight (wait(1), the previous slot refilled)
# and stages for two programs per SM; configurations side by side with the Triton kernel.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 520 python3 -m loopjax.bench.probes.pdl_chain --rows 1,8,32 --out $OUT/chain.json \
  --arms triton,pdl_off,pdl,pdl@t3,pdl@t12,pdl@n128,pdl@n128t4,pdl@k128t3,pdl@s8 2>&1 | grep -v Warning
