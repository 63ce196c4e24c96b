# Run 17 call 11: traces of the Ouro-1.4B decode step (1 and 32 rows, context 512) with matmul
# 'persistent' and 'auto': where the persistent MLP kernel's step time goes.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul persistent,auto --per-loop-rows 0 --context 512 --rows 1,32 --iters 10 --trace /tmp/trc > /tmp/trace.log 2>&1
echo "rc=$?"; grep -v Warning /tmp/trace.log | grep " rows \|^device\|^gaps\|^ *[0-9.]* *[0-9]* *[0-9.]*  [a-z]" | grep -v "kernel groups" | awk '!seen[$0]++' | cut -c1-150 | head -90
cd /tmp && tar czf $OUT/logs.tgz trace.log
