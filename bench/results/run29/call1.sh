# Run 29 call 1: the Mosaic decode attention prefetching the layer's wo into L2 (this tree)
# against f95b18a (_base, run from its own folder); Ouro-1.4B, matmul auto.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
S="--preset ouro-1.4b --backend pallas_mgpu --per-loop-rows 0 --iters 10 --matmul auto"
st() { tag=$1; dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 200 python3 -m loopjax.bench.decode_step $S "$@" --out $OUT/$tag.json > $OUT/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E " rows |rror" $OUT/$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu //' | cut -c1-140; }
st new1 . --context 512 --rows 1,8,32,64
st old1 _base --context 512 --rows 1,8,32,64
st new2 . --context 512 --rows 1,8,32,64
st new3 . --context 2048 --rows 1,32
st old3 _base --context 2048 --rows 1,32
