# Run 28 call 1 (session 21): Ouro's attention-branch norms in w_gate_up's prologue
# (kernels/persistent_mlp.py phases 0 + 1, matmul_ops 'fused' op). Checks on the H200, then
# the decode step with the fused op ('base': MOSAIC_ROWS as committed) against the same tree
# without it ('unfused': the norms kernel between wo's partials and SiLU*up, as before), and
# the tree before the change (_base = 87a9e37).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
inst() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
inst .
echo "== ops_check (rows 1, 8, 32, 64: each variant against XLA's ops)"
timeout 200 python3 -m loopjax.bench.probes.ops_check --rows 1,8,32,64 \
  --variants "matmul auto,matmul auto unfused" > $OUT/ops_check.log 2>&1; echo "rc=$?"
grep -E "rows|FAIL|rror" $OUT/ops_check.log | cut -c1-160
S="--preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --iters 10"
UNF="qkv=1,8,16,32,64+silu=8,16,32,64+norms=8,16,32,64+partials=8,16,32,64"
st() { tag=$1; shift
  timeout 200 python3 -m loopjax.bench.decode_step $S "$@" --out $OUT/$tag.json > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E " rows |rror" $OUT/$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu auto xla fused //' | cut -c1-170; }
st new1 --rows 1,8,32,64 --mosaic-rows "base;$UNF"
inst _base
st old1 --rows 1,8,32,64
inst .
st new2 --rows 1,8,32,64 --mosaic-rows "$UNF;base"
st trace --rows 1,8,32 --trace $OUT/trace
tail -40 $OUT/trace.log | cut -c1-160
