# Run 18 call 6 (the session's defaults: Mosaic qkv + RoPE at 1-64 rows, SiLU*up and the norms'
# partials at 8-32): the Ouro-1.4B decode step table (1/8/32/128 rows, contexts 512 and 2048,
# % of roofline) and traces of the 1- and 32-row steps (kernels per layer application).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 260 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 1,32 --context 512,2048 --rows 1,8,32,128 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-250
timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,32 --iters 10 --trace /tmp/tr --out $OUT/trace_steps.json > /tmp/trace.log 2>&1
echo "trace rc=$?"; grep " rows \|rror" /tmp/trace.log | cut -c1-250
grep -A34 "^device:" /tmp/trace.log | grep -v "^--" | cut -c1-150 | head -80
cd /tmp && tar czf $OUT/logs.tgz *.log
