# Run 28 call 5: the persistent MLP (matmul 'persistent') with its phase-1 programs signalling
# before they put their phase-2 weight tiles in flight (call 4: a release fence waits for the
# signaller's copies in flight), against 0ad074f (_base: tiles first, as since run 17).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
inst() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
S="--preset ouro-1.4b --backend pallas_mgpu --per-loop-rows 0 --context 512 --iters 10"
run() { tag=$1; shift
  timeout 150 python3 -m loopjax.bench.probes.persistent_mlp_check --rows 1,8,32 --out $OUT/pmlp_$tag.json \
    > $OUT/pmlp_$tag.log 2>&1; echo "== $tag persistent_mlp_check rc=$?"; grep -v "^WARNING" $OUT/pmlp_$tag.log | tail -12
  timeout 200 python3 -m loopjax.bench.decode_step $S --matmul auto,persistent --rows 1,8,32 \
    --out $OUT/step_$tag.json > $OUT/step_$tag.log 2>&1
  echo "== $tag decode_step rc=$?"; grep -E " rows |rror" $OUT/step_$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu //' | cut -c1-150; }
inst .; run new1
inst _base; run old
inst .; run new2
