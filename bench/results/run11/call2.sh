set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.kernels --only pointwise --seeds 6 --out $OUT/pointwise.json > $OUT/pointwise.log 2>&1; echo "pointwise rc=$?"; grep -v xla_ref $OUT/pointwise.log | tail -40
timeout 290 python3 -m loopjax.bench.matmul --no-step --no-norm --max-seconds 270 > $OUT/matmul.log 2>&1; echo "matmul rc=$?"; tail -75 $OUT/matmul.log
timeout 140 python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,32 --context 512 --backend pallas_mgpu --per-loop-rows 1 --out $OUT/decode_huginn.json > $OUT/decode_huginn.log 2>&1; echo "huginn rc=$?"; tail -8 $OUT/decode_huginn.log
