# Run 23 call 1 (this session's tree: penalties and logit_bias on the device): what the full
# sampler's new work costs. The decode step with every row sampling (`--sampled-case`: top-p
# 0.9, the executable penalized requests run) and greedy, on this tree and on the base tree
# (d2a8539, shipped as _base/), alternating; each arm in its own process.
set -u
# Each arm installs its tree (pip -e) first: loopjax.bench maps to bench/ through pyproject.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
S="--preset ouro-1.4b --rows 1,32 --context 512 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 20 --sampled-case"
st() { tag=$1 dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 200 python3 -m loopjax.bench.decode_step $S --out /tmp/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "fused|rows" /tmp/$tag.log | tail -8 | cut -c1-160; }
st steps_new1 .
st steps_base1 _base
st steps_new2 .
cd /tmp && tar czf $OUT/call1.tgz steps_*.*
