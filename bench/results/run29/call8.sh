# Run 29 call 8: Programmatic Dependent Launch with nothing between the kernels. Run 17's chains
# put an XLA kernel (the split-K sum, SiLU*up) between consecutive PDL kernels, and XLA's
# kernels never trigger their dependents early. Here the wo chain (x <- x @ wo) runs the
# swapped PDL kernel with split_k 1 at 8 and 32 rows: its [M, N] output is the next x (no
# kernel between). Arms with and without the early launch, the default split for contrast.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 550 python3 -m loopjax.bench.probes.pdl_chain --chains wo --rows 8,32 --iters 20 \
  --arms pdl_off@swaps1,pdl@swaps1,pdl_off@swap,pdl@swap,triton --trace /tmp/tr8 --out $OUT/call8.json 2>&1 \
  | grep -E "^wo |loopjax|^device|^gaps|rror" | cut -c1-150
