set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 60 python3 -m loopjax.bench.probes.rms_tiling --cases 2048:128 --names add_rms_norm_native > $OUT/rms_native.log 2>&1; echo "rms rc=$?"; tail -3 $OUT/rms_native.log
timeout 360 python3 -m loopjax.bench.matmul --sweep --shapes huginn,ouro --rows 8,32,1 --max-seconds 340 > $OUT/sweep.log 2>&1; echo "sweep rc=$?"; grep -A40 "fastest config" $OUT/sweep.log; grep -c "pallas" $OUT/sweep.log
