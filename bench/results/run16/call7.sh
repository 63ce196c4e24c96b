# Run 16 call 7 (tree with the session's defaults: greedy executable, 16-bit sort, Huginn's
# adapter halves): issue 9's step table (Ouro-1.4B 1/8/32/128 rows at contexts 512 and 2048,
# Huginn-0125 1/8/32 rows at 512 and 2048), greedy rows, pipelined.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512,2048 --rows 1,8,32,128 --iters 20 --out $OUT/o_table.json > /tmp/o_table.log 2>&1; echo "== o_table rc=$?"; grep " rows " /tmp/o_table.log | cut -c1-230
timeout 250 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512,2048 --rows 1,8,32 --iters 10 --out $OUT/h_table.json > /tmp/h_table.log 2>&1; echo "== h_table rc=$?"; grep " rows " /tmp/h_table.log | cut -c1-230
cd /tmp && tar czf $OUT/logs.tgz *.log
