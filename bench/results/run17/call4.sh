# Run 17 call 4: where the PDL kernel's time goes: traces of the chains (triton vs the PDL
# kernel with 128-column tiles, with and without the early launch) at 1 and 32 rows.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 python3 -m loopjax.bench.probes.pdl_chain --rows 1,32 --trace /tmp/trc --out $OUT/chain.json \
  --arms triton,pdl_off@n128,pdl@n128 > /tmp/chain.log 2>&1; echo "rc=$?"
grep -v Warning /tmp/chain.log | grep -i "µs/layer\|loopjax\|triton\|fusion\|busy\|gap\|kernel" | cut -c1-200 | head -150
cd /tmp && tar czf $OUT/logs.tgz chain.log
