# Run 21 call 2 (tree 4546bd3: the prefill attention's query blocks heaviest first; the
# tree before it, 4a1fcce, shipped as _base/). Prefill steps traced, A/B; and the pointwise
# kernels (norms, SiLU*up) against XLA's fusions at a prefill step's 2,048 tokens.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
PF="--preset ouro-1.4b,huginn-0125 --shapes 4x512,1x2048 --huginn-shapes 4x512 --backend pallas --startup-backends none --iters 10"
pf() { tag=$1
  timeout 200 python3 -m loopjax.bench.prefill $PF --trace /tmp/tr_$tag --out /tmp/prefill_$tag.json > /tmp/pf_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "of peak|paged_prefill" /tmp/pf_$tag.log | cut -c1-150; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
pf new
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && pf base)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.kernels --only pointwise --tokens 2048 --out /tmp/pointwise.json > /tmp/pointwise.log 2>&1
echo "== pointwise rc=$?"; grep -E "N=2048" /tmp/pointwise.log | cut -c1-150
cd /tmp && tar czf $OUT/call2.tgz *.log *.json
