# Run 27 call 4 (tree c65e074 + the kernel's min_blocks_per_split, the decode_step 'S:M' split
# arms): the Mosaic decode attention with S context splits of at least M blocks (64 keys) each,
# in the Ouro-1.4B decode step at contexts 512 / 2,048 / 8,192 / 32,768 (8 rows: up to 8,192).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S="--preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 10 --kv-gb 110"
st() { tag=$1; shift
  timeout 190 python3 -m loopjax.bench.decode_step $S "$@" --out $OUT/$tag.json > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E " rows |rror" $OUT/$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu auto xla fused //' | cut -c1-150; }
st r1 --rows 1 --context 512,2048,8192,32768 --attn-splits auto,8:2,8:4,16:4
st r4 --rows 4 --context 512,2048,8192,32768 --attn-splits auto,2:2,4:2,4:4
st r8 --rows 8 --context 512,2048,8192 --attn-splits auto,2:8,2:16
