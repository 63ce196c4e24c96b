# Run 15 call 6 (tree: call 5's): Huginn-0125 steps at 8 and 32 rows with w_gate_up (SiLU*up
# in the kernel's epilogue) and the adapter on the streaming kernel ('auto' keeps them on XLA
# from 8 rows), and the decode attention at 2 slots in flight (call 5: 1.1 waves at 3).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 220 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 8,32 --iters 10 --attn-stages auto,2 --streaming-rows "base;5280x35840:32,10560x5280:32" --out $OUT/h_stream.json > /tmp/h_stream.log 2>&1
echo "== h_stream rc=$?"; grep " rows \|rror" /tmp/h_stream.log | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz *.log
