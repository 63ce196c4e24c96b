# Run 21 call 7 (the session's final kernels and routing, after the attend_projected refactor):
# one traced Ouro-1.4B 4 x 512 prefill step, to see the rotating write and the heaviest-first
# attention in the final tree.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.prefill --preset ouro-1.4b --shapes 4x512 --backend pallas --startup-backends none --iters 10 --trace /tmp/tr --out /tmp/prefill.json > /tmp/pf.log 2>&1
echo "== rc=$?"; grep -E "of peak|rope_write|paged_prefill|write_kv|concatenate|wrapped_slice" /tmp/pf.log | cut -c1-160
cd /tmp && tar czf $OUT/call7.tgz pf.log prefill.json
