# Run 14 call 3: KV scatters with unique_indices (kv_cache.write_plane): prefill steps and the bursts.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --shapes 4x512 --huginn-shapes 4x512 --backend pallas --startup-backends none --trace /tmp/ptrace --out $OUT/p_unique.json > /tmp/p_unique.log 2>&1
echo "== p_unique rc=$?"; grep "scatter\|% of peak\|^|" /tmp/p_unique.log | cut -c1-180 | head -30
bash bench/gpu_run.sh burst_ouro:170 burst_huginn:150 2>&1 | grep "===\|rc=\|burst on\|engine ready" | cut -c1-250
cd /tmp && tar czf $OUT/logs.tgz *.log; cp $OUT/*.log /tmp/ 2>/dev/null; cd $OUT && tar czf gpu_run_logs.tgz *.log && rm -f *.log
