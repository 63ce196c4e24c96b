# Run 14 call 8 (tree 6237cc1): the Mosaic decode attention's in-kernel split combine: GPU check
# (bitwise repeats, vs the old path and the reference), then 1- and 4-row Ouro-1.4B steps against
# the same tree before the change (a1fd0f1, shipped as a plain copy in _base/).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
steps() { tag=$1
  timeout 100 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512,2048 --rows 1,4 --iters 30 --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows \|rror" /tmp/$tag.log | cut -c1-200; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.probes.attn_combine_check > /tmp/combine_check.log 2>&1
echo "== combine_check rc=$?"; grep -v "^\s*$\|cuda_timer" /tmp/combine_check.log | cut -c1-200 | tail -30
steps o_combine
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && steps o_base)
cd /tmp && tar czf $OUT/logs.tgz *.log
