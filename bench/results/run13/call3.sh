# Run 13 call 3: norm_add_norm with one row per program; Ouro-1.4B steps at 1/8/16/32 rows
# against the base commit d1b3cd1 (same run), and which products to stream from 8 rows now
# that the split-K partials go to the fused norms; the kernel's bitwise check on the H200;
# the model-level Ops probe on both commits.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
here=$(pwd)
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --iters 20 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-200; }
git worktree add -q /tmp/base d1b3cd1 && cp bench/probes/ops_check.py /tmp/base/bench/probes/ && cd /tmp/base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.kernels; print('base imports', loopjax.kernels.__file__)"
ds base 130 --rows 1,8,16,32
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 1,8 > /tmp/ops_base.log 2>&1; echo "== ops_base rc=$?"; tail -6 /tmp/ops_base.log
cd $here && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.kernels; print('new imports', loopjax.kernels.__file__)"
echo "commit $(git rev-parse --short HEAD)"
ds new 200 --rows 1,8,16,32 "--streaming-rows=base;2048x11264:8;2048x2048:32,5632x2048:32;2048x2048:32,5632x2048:32,2048x6144:32,2048x11264:32"
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 1,8 > /tmp/ops_new.log 2>&1; echo "== ops_new rc=$?"; tail -6 /tmp/ops_new.log
timeout 120 python3 -m loopjax.bench.kernels --only pointwise --seeds 2 --budget 90 --out $OUT/pointwise.json > /tmp/pointwise.log 2>&1; echo "== pointwise rc=$?"; grep "norm_add_norm\|MISMATCH" /tmp/pointwise.log
cd /tmp && tar czf $OUT/logs.tgz *.log
