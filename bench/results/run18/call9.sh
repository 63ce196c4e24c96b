# Run 18 call 9: after persistent_mlp's rings shrink to fit shared memory at 64 rows (call 8's
# ops_check stopped there), one Ouro loop at 64 rows on each Ops against XLA's; burst-128
# twice in one engine (call 8 ran it once: 3,923 tok/s; run 16 saw 8% between runs).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 64 > /tmp/ops.log 2>&1
echo "ops rc=$?"; grep "rows\|rror" /tmp/ops.log | cut -c1-200
timeout 110 python3 -m loopjax.bench.cli ouro-1.4b -C 128 128 --max-num-rows 128 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 95 --out $OUT/b_ouro128.json > /tmp/b_ouro128.log 2>&1
echo "b_ouro128 rc=$?"; grep "burst on\|engine ready" /tmp/b_ouro128.log | cut -c1-260
cd /tmp && tar czf $OUT/logs.tgz *.log
