set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.probes.rms_tiling > $OUT/rms_tiling.log 2>&1; echo "rms rc=$?"; grep -v JSON $OUT/rms_tiling.log | tail -40
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --rows 32 --context 512 --backend pallas_mgpu --per-loop-rows 0 --iters 3 > $OUT/dump_decode.log 2>&1; echo "dump rc=$?"; tail -5 $OUT/dump_decode.log
ls -S /tmp/dump | head -5; (cd /tmp/dump && tar czf $OUT/dump.tgz $(ls -S *after_optimizations.txt | head -3))
bash bench/gpu_run.sh burst_ouro:130 burst_huginn:100 2>&1 | grep -v "^\s*$" | tail -60
