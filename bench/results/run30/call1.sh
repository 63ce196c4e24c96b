#!/bin/bash
# Run 30 call 1: the tail prefetch probe (SiLU*up -> w_down partials -> norms, Ouro-1.4B, 8 and
# 32 rows), then PDL chains long enough (64 loops = 1,536 kernels a call) that dispatch is amortized.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 330 python3 -m loopjax.bench.probes.tail_prefetch --rows 8,32 --repeats 2 --iters 20 \
  --arms plain,tail@d448g384,tail@d128g128,tail@d448g0,tail@d0g384 --out $OUT/tail.json 2>&1 | grep -E "^rows|rror"
timeout 120 python3 -m loopjax.bench.probes.pdl_chain --chains wo --rows 8,32 --loops 64 --iters 10 \
  --arms pdl_off@swaps1,pdl@swaps1,pdl_off@swaps1,pdl@swaps1 --out $OUT/pdl_a.json 2>&1 | grep -E "^wo |rror"
timeout 120 python3 -m loopjax.bench.probes.pdl_chain --chains wo --rows 8,32 --loops 64 --iters 10 \
  --arms pdl@swaps1,pdl_off@swaps1,pdl@swaps1,pdl_off@swaps1 --out $OUT/pdl_b.json 2>&1 | grep -E "^wo |rror"
