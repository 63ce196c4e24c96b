set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 8,32 --context 512 --backend pallas_mgpu --matmul xla,auto --per-loop-rows 0 --out $OUT/decode_ouro_auto.json > $OUT/decode_ouro_auto.log 2>&1; echo "ouro rc=$?"; grep fused $OUT/decode_ouro_auto.log
timeout 120 python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 1 --out $OUT/decode_huginn_tuned.json > $OUT/decode_huginn_tuned.log 2>&1; echo "huginn rc=$?"; grep "rows" $OUT/decode_huginn_tuned.log
bash bench/gpu_run.sh burst_ouro:100 burst_huginn:100 2>&1 | grep -v "cuda_timer\|^\s*$" | grep "burst on\|engine ready\|rc="
