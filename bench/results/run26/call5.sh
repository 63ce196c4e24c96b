# Run 26 call 5 (tree 9e2c358 + bench/probes/l2_prefetch_probe.py with --trace): where the
# small Mosaic kernel's cost goes in call 4's chains (kernels, copies, gaps per chain).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 python3 -m loopjax.bench.probes.l2_prefetch_probe --rows 1,32 --programs 16 --trace /tmp/l2tr 2>&1 | grep -v "cuda_timer\|^W1" > $OUT/l2_trace.txt
grep -E "^rows|gaps|device:|us  |µs" $OUT/l2_trace.txt | head -120
