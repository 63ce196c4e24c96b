# Run 18 call 7: 64-row Ouro-1.4B steps with the qkv and gate_up products streamed at 64 rows
# (today XLA there) and the Mosaic ops at 64 rows, in each combination; 'base' again last.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M64="qkv=1,8,16,32,64+silu=8,16,32,64+norms=8,16,32,64"
timeout 300 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --streaming-rows "base;2048x6144:64,2048x11264:64" --mosaic-rows "base;$M64" --per-loop-rows 0 --context 512 --rows 64 --iters 20 --out $OUT/steps64.json > /tmp/steps64.log 2>&1
echo "steps64 rc=$?"; grep " rows \|rror" /tmp/steps64.log | cut -c1-250
timeout 100 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 64 --iters 20 --out $OUT/steps64_base.json > /tmp/steps64_base.log 2>&1
echo "steps64_base rc=$?"; grep " rows \|rror" /tmp/steps64_base.log | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz *.log
