# Run 27 call 3 (tree c65e074): the Mosaic decode attention's context splits at long contexts
# (never measured above 2,048): the Ouro-1.4B decode step at contexts 8,192 (1, 4, 8 rows) and
# 32,768 (1, 4 rows) with the default rule (mosaic_num_splits: 4 splits at 1 row, 1 from 4
# rows) against fixed 4 / 8 / 16 splits.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S="--preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 10 --kv-gb 110 --attn-splits auto,4,8,16"
timeout 280 python3 -m loopjax.bench.decode_step $S --context 8192 --rows 1,4,8 --out $OUT/ctx8k.json > $OUT/ctx8k.log 2>&1
echo "8k rc=$?"; grep -E " rows |rror" $OUT/ctx8k.log | sed -E 's/ +/ /g' | cut -c1-200
timeout 250 python3 -m loopjax.bench.decode_step $S --context 32768 --rows 1,4 --out $OUT/ctx32k.json > $OUT/ctx32k.log 2>&1
echo "32k rc=$?"; grep -E " rows |rror" $OUT/ctx32k.log | sed -E 's/ +/ /g' | cut -c1-200
