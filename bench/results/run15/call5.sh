# Run 15 call 5 (tree: call 4's + decode_step --attn-stages): the Mosaic decode attention's slots
# in flight (default 3: 2 or 3 programs per SM by shared memory) at 2 / 3 / 4, in the step.
# Huginn-0125 at 8 rows runs 440 (token, head) programs: 1.1 waves of 3 per SM.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 10 --attn-stages auto,2,4 --out $OUT/h_stages.json > /tmp/h_stages.log 2>&1
echo "== h_stages rc=$?"; grep " rows \|rror" /tmp/h_stages.log | cut -c1-230
timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32,128 --iters 20 --attn-stages auto,2,4 --out $OUT/o_stages.json > /tmp/o_stages.log 2>&1
echo "== o_stages rc=$?"; grep " rows \|rror" /tmp/o_stages.log | cut -c1-230
cd /tmp && tar czf $OUT/logs.tgz *.log
