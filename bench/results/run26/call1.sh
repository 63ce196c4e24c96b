# Run 26 call 1 (working tree after dc75918: kernels/tiled_matmul.py). The prefill MLP's first
# product with SiLU*up: XLA's GEMM + SiLU*up kernel vs the tiled Pallas kernel per config.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for rows in 2048 512; do
  timeout 240 python3 -m loopjax.bench.probes.tiled_silu_probe --rows $rows 2>&1 | grep -v "cuda_timer\|^W1" | tee $OUT/probe_$rows.txt
done
