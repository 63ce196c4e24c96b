# Run 26 call 4 (tree 9e2c358 + bench/probes/l2_prefetch_probe.py): does an L2 prefetch of the
# next product's weight, issued by a small Mosaic kernel before each product, shorten a chain
# of dependent decode products (Ouro-1.4B's wo shape; then w_down-sized square weights)?
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 280 python3 -m loopjax.bench.probes.l2_prefetch_probe --rows 1,8,32 --programs 16,66 2>&1 | grep -v "cuda_timer\|^W1" | tee $OUT/l2_2048.txt
timeout 200 python3 -m loopjax.bench.probes.l2_prefetch_probe --rows 1,32 --programs 66 --shape 4096x4096 --chain 24 2>&1 | grep -v "cuda_timer\|^W1" | tee $OUT/l2_4096.txt
