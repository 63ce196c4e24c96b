# Run 17 call 7: the swapped PDL kernel with x's K range loaded once (few rows) and wider K
# tiles; chains traced (per-kernel µs) beside the Triton kernel.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 -m loopjax.bench.probes.pdl_chain --rows 1,8,32 --trace /tmp/trc --out $OUT/chain.json \
  --arms triton,pdl@swap,pdl@swapk128t6,pdl@swapk128t8,pdl@swapk256t3,pdl_off@swapk128t6 > /tmp/chain.log 2>&1; echo "rc=$?"
grep -v Warning /tmp/chain.log | grep "µs/layer\|^ *[0-9.]* *[0-9]* *[0-9.]*  loopjax" | grep -v "kernel groups" | awk '!seen[$0]++' | cut -c1-150
cd /tmp && tar czf $OUT/logs.tgz chain.log
