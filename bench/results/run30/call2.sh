#!/bin/bash
# Run 30 call 2: matmul 'persistent' as phases 1-2 of kernels/persistent_mlp.py + the norms kernel
# (bench/results/run30/persistent12.py) against 'auto', in one process, then the other order.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
args="--preset ouro-1.4b --backend pallas_mgpu --per-loop-rows 0 --context 512 --iters 10"
timeout 380 python3 bench/results/run30/persistent12.py $args --matmul auto,persistent --rows 1,8,32,64 \
  --out $OUT/p12_a.json 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -30
timeout 190 python3 bench/results/run30/persistent12.py $args --matmul persistent,auto --rows 8,32 \
  --out $OUT/p12_b.json 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -20
