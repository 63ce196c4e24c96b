# Run 28 call 2: where the fused op's time goes (call 1: +3.5-4.3 µs per layer application
# against the norms kernel + SiLU*up). bench/probes/norms_prologue.py: 'unfused' (the norms
# kernel, then 'auto''s SiLU*up), 'phase1' (the stream alone, x given), 'fused@tTpP' (T ring
# slots, P weight tiles per program prefetched into L2 while the rows are normed).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 -m loopjax.bench.probes.norms_prologue --rows 1,8,32 --iters 10 \
  --arms unfused,phase1,phase1@t11,fused@t6p0,fused@t11p0,fused@t6p26,fused@t11p21,fused@t6p12 \
  --out $OUT/norms_prologue.json 2>&1 | grep -v "^WARNING" | tail -40
