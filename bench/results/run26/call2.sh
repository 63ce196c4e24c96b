# Run 26 call 2: jax's example Mosaic GPU matmul against XLA's GEMM at the prefill MLP's shape
# (bench/results/run26/mosaic_gemm_probe.py), and the tiled SiLU*up probe at 1,024 and 256 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 300 python3 bench/results/run26/mosaic_gemm_probe.py 2>&1 | grep -v "cuda_timer\|^W1" | tee $OUT/mgpu.txt
for rows in 1024 256; do
  timeout 100 python3 -m loopjax.bench.probes.tiled_silu_probe --rows $rows 2>&1 | grep -v "cuda_timer\|^W1" | tee $OUT/probe_$rows.txt
done
