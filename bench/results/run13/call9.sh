# Run 13 call 9: warm-up of the default engine (max 32 rows) with norm_add_norm lowered once
# per configuration, and its burst-32.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 130 --out $OUT/b_default.json > $OUT/b_default.log 2>&1
echo "== b_default rc=$?"; grep "burst on\|engine ready\|executables" $OUT/b_default.log | cut -c1-300
