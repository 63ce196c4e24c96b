# Run 28 call 7: the final tree (its default SiLU*up kernel issuing weight and x tiles slot by
# slot, as before; the persistent MLP signalling before its phase-2 copies) against 87a9e37
# (_base, run from its own folder), matmul auto and persistent.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
S="--preset ouro-1.4b --backend pallas_mgpu --per-loop-rows 0 --context 512 --iters 10 --matmul auto,persistent"
st() { tag=$1; dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 170 python3 -m loopjax.bench.decode_step $S --rows 1,8,32,64 --out $OUT/$tag.json > $OUT/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E " rows |rror" $OUT/$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu //' | cut -c1-140; }
st new1 .
st old _base
st new2 .
