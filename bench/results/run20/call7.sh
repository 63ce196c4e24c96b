# Run 20 call 7 (tree with min_tokens; 8b6a70f, the tree before it, shipped as _base/): the
# sampler now sets each row's suppressed stop ids to -inf (none without min_tokens: a dropped
# scatter). Does that cost anything in the Ouro-1.4B decode step (greedy and sampled rows)?
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
STEP="--preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,32 --sampled-case --iters 20"
ds() { tag=$1
  timeout 200 python3 -m loopjax.bench.decode_step $STEP --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows " /tmp/$tag.log | cut -c1-200; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds new
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && ds base)
cd /tmp && tar czf $OUT/logs.tgz *.log
