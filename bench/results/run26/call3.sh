# Run 26 call 3: prefill steps with the tiled SiLU*up kernel at 256 / 512 rows (matmul 'auto',
# matmul_ops.TILED_ROWS; the working tree) against the tree before it (dc75918, as _base/).
# Arms alternate new, base, new, base; one process each.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
PF="--preset ouro-1.4b --shapes 1x256,1x512,2x512,4x512 --huginn-shapes none --backend pallas --startup-backends none --iters 20"
pf() { tag=$1
  timeout 200 python3 -m loopjax.bench.prefill $PF --out $OUT/prefill_$tag.json > $OUT/pf_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "of peak" $OUT/pf_$tag.log | cut -c1-150; }
for i in 1 2; do
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; pf new$i
  (cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && pf base$i)
done
