# Run 28 call 3: call 2's probe with the two arms that split the prologue's cost: the handoff
# alone (fused-nowork: phase 0 only signals) and phase 0's work beside the stream
# (fused-nowait: phase 1 does not wait).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 -m loopjax.bench.probes.norms_prologue --rows 1,8,32 --iters 20 \
  --arms unfused,phase1,fused@t6,fused-nowork@t6,fused-nowait@t6,unfused,fused@t6 \
  --out $OUT/norms_prologue.json 2>&1 | grep -v "^WARNING" | tail -40
