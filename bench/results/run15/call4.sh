# Run 15 call 4 (tree: 3d61de0 + call 1's TUNED): where a Huginn-0125 8-row step and an
# Ouro-1.4B 1-row step spend their time now (decode_step --trace: kernels per step).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 8 --iters 10 --trace /tmp/htrace --out $OUT/h_trace8.json > /tmp/h_trace8.log 2>&1
echo "== h_trace8 rc=$?"; grep " rows \|rror" /tmp/h_trace8.log | cut -c1-220; grep -A45 "top kernels\|per step" /tmp/h_trace8.log | cut -c1-150 | head -60
timeout 100 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1 --iters 20 --trace /tmp/otrace --out $OUT/o_trace1.json > /tmp/o_trace1.log 2>&1
echo "== o_trace1 rc=$?"; grep " rows \|rror" /tmp/o_trace1.log | cut -c1-220
cd /tmp && tar czf $OUT/logs.tgz *.log
