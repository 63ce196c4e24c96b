# Run 28 call 4: calls 2-3 put every phase-1 program's first weight tiles in flight before the
# row programs norm and signal; if the signal's release fence waits for the signaller's own
# copies in flight, the row programs should signal first (the kernel now does:
# ROWS_SIGNAL_FIRST; 'fused-tilesfirst' is the order of calls 2-3). Then the persistent MLP's
# device check (its phase 1 now stores act through shared memory where M is not its padding).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 python3 -m loopjax.bench.probes.norms_prologue --rows 1,8,32 --iters 20 \
  --arms unfused,phase1,fused@t6,fused-tilesfirst@t6,fused-nowork@t6,fused@t11,unfused,fused@t6 \
  --out $OUT/norms_prologue.json 2>&1 | grep -v "^WARNING" | tail -40
timeout 150 python3 -m loopjax.bench.probes.persistent_mlp_check --rows 1,3,8,32 --out $OUT/pmlp.json \
  > $OUT/pmlp.log 2>&1; echo "persistent_mlp_check rc=$?"; grep -v "^WARNING" $OUT/pmlp.log | tail -16
