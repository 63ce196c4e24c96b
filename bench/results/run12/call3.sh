# Run 12 call 3: the sampler's sort (float comparator vs int keys); decode steps timed back to
# back (pipelined) beside the synchronous median; Ouro's 32-row streaming experiments again.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 90 python3 -m loopjax.bench.probes.sort_probe > /tmp/sort_probe.log 2>&1; echo "sort rc=$?"; cat /tmp/sort_probe.log
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-220; }
ds o_stream 200 --preset ouro-1.4b --rows 1,8,32 --iters 20 "--streaming-rows=base;2048x2048:32;5632x2048:32;2048x11264:32"
ds h_pipe 100 --preset huginn-0125 --rows 1,8,32
cd /tmp && tar czf $OUT/logs.tgz *.log
