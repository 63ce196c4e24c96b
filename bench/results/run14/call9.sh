# Run 14 call 9 (tree 156f696, as call 7): burst-128 and burst-32 again (call 7's burst-128 was
# one run at 4,012 tok/s, at the 4,000 target).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 128 32 128 --max-num-rows 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 180 --out $OUT/b_ouro.json > /tmp/b_ouro.log 2>&1
echo "== b_ouro rc=$?"; grep "burst on\|engine ready" /tmp/b_ouro.log | cut -c1-260
cd /tmp && tar czf $OUT/logs.tgz *.log
