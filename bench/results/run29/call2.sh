# Run 29 call 2: traces of the 1-row and 32-row Ouro-1.4B steps (context 512), the prefetching
# tree against f95b18a (_base): per-position kernel times (does wo read faster after the
# attention kernel's prefetch?).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
S="--preset ouro-1.4b --backend pallas_mgpu --per-loop-rows 0 --iters 10 --matmul auto --context 512 --rows 1,32"
st() { tag=$1; dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 250 python3 -m loopjax.bench.decode_step $S --trace /tmp/tr_$tag > $OUT/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -vE "^(WARNING|I0|W0)" $OUT/$tag.log | tail -60 | cut -c1-160; }
st new .
st old _base
