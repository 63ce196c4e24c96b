# Run 14 call 11: prefill steps with the engine's products (bench/prefill.py now takes
# --matmul, default auto): 'auto' (dots in the dtype on the GPU) vs 'xla' (fp32 dot + convert).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for mm in auto xla; do
timeout 100 python3 -m loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --shapes 4x512 --huginn-shapes 4x512 --backend pallas --matmul $mm --startup-backends none --trace /tmp/ptrace_$mm --out $OUT/p_$mm.json > /tmp/p_$mm.log 2>&1
echo "== p_$mm rc=$?"; grep "wrapped_convert\|% of peak" /tmp/p_$mm.log | grep -v "^|" | cut -c1-160 | head -8
done
cd /tmp && tar czf $OUT/logs.tgz *.log
