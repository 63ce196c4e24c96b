# Run 15 call 1 (tree 3d61de0 + the sampler's cond on all-greedy batches, bench options):
# 1) Ouro-1.4B steps, greedy and all-top-p rows, against 3d61de0 (shipped as _base/);
# 2) the Mosaic decode attention's pages-per-block / stages at 8 and 32 rows x 512;
# 3) a wide block-size sweep of the products as the step runs them (Ouro wo, w_down, w_gate_up;
#    Huginn wo) at 1, 8, 32 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
steps() { tag=$1; shift
  timeout 110 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 20 --out $OUT/$tag.json "$@" > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows \|rror" /tmp/$tag.log | cut -c1-220; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
steps o_cond --sampled-case
timeout 80 python3 -c "
from loopjax.bench import kernels as k
import jax.numpy as jnp
b = k.Bench(False, 20, 70)
cfgs = [(4, s, None) for s in (2, 3, 4, 5, 6)] + [(8, s, None) for s in (2, 3)] + [(16, 1, None)]
k.bench_sweep(b, {'ouro-1.4b': k.MODELS['ouro-1.4b']}, [(32, 512), (8, 512), (32, 640)], jnp.bfloat16, False, 16, [], cfgs)
" > /tmp/attn_sweep.log 2>&1
echo "== attn_sweep rc=$?"; grep -v "^\s*$" /tmp/attn_sweep.log | cut -c1-160 | tail -30
timeout 250 python3 -m loopjax.bench.matmul --sweep --wide --shapes ouro,huginn --products ouro.wo,ouro.w_down,ouro.w_gate_up,huginn.wo --rows 32,8,1 --max-seconds 235 > /tmp/sweep.log 2>&1
echo "== sweep rc=$?"; grep "fastest\|Config\|done\|copy rate" /tmp/sweep.log
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && steps o_base)
cd /tmp && tar czf $OUT/logs.tgz *.log
