# Run 17 call 12: the refactored Mosaic kernels (kernels/_mgpu.py's shared ring) re-checked on
# the device: persistent MLP vs its twin and in the chains, the swapped PDL product, and one
# Ouro loop with matmul 'persistent' against XLA's.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.probes.persistent_mlp_check --rows 1,8,32 --iters 10 --out $OUT/pmlp.json 2>&1 | grep -v Warning | grep "rows" | cut -c1-220
timeout 90 python3 -m loopjax.bench.probes.pdl_chain --rows 1,32 --arms triton,pdl@swap,pdl_off --iters 10 2>&1 | grep -v Warning | grep "µs/layer\|FAILED" | cut -c1-160
timeout 90 python3 -m loopjax.bench.probes.ops_check --rows 1,32 2>&1 | grep "rows\|rror" | cut -c1-200
