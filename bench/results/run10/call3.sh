# Run 10, call 3: rms reduction-order probe; warm-up with 3 decode buckets, cold then from the
# persistent compilation cache; profile of burst-32 decode with the Mosaic attention.
set -u; OUT=${OUT:-/tmp/out}; export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1
B="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 128 --max-num-rows 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --decode-row-buckets 8 32 128 --compilation-cache-dir /tmp/jaxcc"
run() { name=$1; lim=$2; shift 2; echo "=== $name"; s=$(date +%s); timeout --signal=INT --kill-after=10 $lim "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? in $(( $(date +%s) - s ))s"; grep -v -e Delay -e '^\s*$' "$OUT/$name.log" | tail -n 14; }
run rms_order 90 python3 -m loopjax.bench.probes.rms_order
run burst_b3_cold 170 $B --max-seconds 150 --out $OUT/burst_b3_cold.json
run burst_b3_warm 100 $B --max-seconds 80 --out $OUT/burst_b3_warm.json
run profile_ouro 170 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 64 -C 32 --max-num-rows 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --decode-row-buckets 32 --prefill-token-buckets 512 1024 2048 --compilation-cache-dir /tmp/jaxcc --trace-steps 10 --out $OUT/profile_ouro
du -sh /tmp/jaxcc; cd $OUT && tar czf run10c.tgz *.log *.json profile_ouro 2>/dev/null; rm -rf profile_ouro
