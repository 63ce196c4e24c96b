# Run 13 call 2: Ouro-1.4B's sandwich norms in one kernel (norm_add_norm: split-K sum, norm,
# add, next norm) against the base commit d1b3cd1, same machine, same run; the Ops on the GPU
# against XLA (probe); where a 1- and 32-row step's time goes now (trace).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
here=$(pwd)
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --iters 20 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-200; }
git worktree add -q /tmp/base d1b3cd1 && cd /tmp/base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax, loopjax.kernels; print('base imports', loopjax.__file__, loopjax.kernels.__file__)"
ds base 120 --rows 1,8,32
cd $here && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax, loopjax.kernels; print('new imports', loopjax.__file__, loopjax.kernels.__file__)"
echo "commit $(git rev-parse --short HEAD)"
ds new 170 --rows 1,8,32 --pointwise xla,pallas
timeout 150 python3 -m loopjax.bench.probes.ops_check --rows 1,8 > /tmp/ops_check.log 2>&1; echo "== ops_check rc=$?"; cat /tmp/ops_check.log | tail -8
ds new_trace 100 --rows 1,32 --trace /tmp/trace
cd /tmp && tar czf $OUT/logs.tgz *.log
grep -B2 -A24 "^device:" /tmp/new_trace.log | head -60
