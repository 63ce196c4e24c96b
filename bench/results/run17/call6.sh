# Run 17 call 6: the PDL kernel with swapped operands (out^T = w_tile^T x^T: x tiles of 8-32
# rows instead of wgmma's 64) against the Triton kernel and the 64-row form, in the chains.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 -m loopjax.bench.probes.pdl_chain --rows 1,8,32 --out $OUT/chain.json \
  --arms triton,pdl@n128,pdl@swap,pdl@swapt11,pdl@swapt16,pdl_off@swapt11,pdl@swapk128t6,pdl@swaps8t8 2>&1 | grep -v Warning
