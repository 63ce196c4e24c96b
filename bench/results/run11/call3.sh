set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 90 python3 -m loopjax.bench.probes.rms_tiling --cases 2048:128,2048:32,2048:2048 --names add_rms_norm,rms_norm > $OUT/rms_probe.log 2>&1; echo "rms rc=$?"; tail -12 $OUT/rms_probe.log
timeout 200 python3 -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,8,32 --context 512 --backend pallas_mgpu --matmul xla,auto --per-loop-rows 0 --out $OUT/decode_huginn_auto.json > $OUT/decode_huginn_auto.log 2>&1; echo "huginn rc=$?"; tail -9 $OUT/decode_huginn_auto.log
bash bench/gpu_run.sh burst_huginn:110 2>&1 | grep -v "cuda_timer\|^\s*$" | tail -8
