# Run 13 call 10: Huginn-0125's fused norms after wo (add_norm_norm) against the commit before
# them (ff04857), same run: decode steps at 8 and 1 rows.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
here=$(pwd)
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --iters 10 --rows 8,1 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows " /tmp/$tag.log | cut -c1-200; }
git worktree add -q /tmp/base ff04857 && cd /tmp/base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds base 100
cd $here && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ds new 100
