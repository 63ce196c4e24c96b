# Run 28 call 6: the Mosaic decode attention's context splits combined inside the kernel (a
# cluster of a q head's splits, split 0 merging the others' partials through distributed shared
# memory) instead of fp32 partials + XLA's combine kernel. Checks on the H200 (the interpreter
# has no peer shared-memory refs), then the 1-row and wide-table 4-row steps against the tree
# before (_base = 0ad074f; the persistent-MLP change of call 5 does not touch matmul auto).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
inst() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
inst .
timeout 200 python3 -m loopjax.bench.probes.attn_write_check > $OUT/attn_check.log 2>&1; echo "attn_write_check rc=$?"
grep -v "^WARNING" $OUT/attn_check.log | tail -9
S="--preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 10 --kv-gb 110"
st() { tag=$1; shift
  timeout 150 python3 -m loopjax.bench.decode_step $S "$@" --out $OUT/$tag.json > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E " rows |rror" $OUT/$tag.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu auto xla fused //' | cut -c1-150; }
both() { st new_$1 "${@:2}"; inst _base; st old_$1 "${@:2}"; inst .; }
both r1 --rows 1 --context 512,2048,8192,32768
both r4 --rows 4 --context 8192
st new_r1b --rows 1 --context 512,2048,8192,32768
