# Run 16 call 3 (tree 5c73992; 4e45a5b shipped as _base/): Huginn-0125 with add_norm_norm (each
# branch's closing norm + the next branch's input norm in one kernel on the product's partials):
# bitwise check of the kernel against its XLA twin, decode steps new vs base, burst-8.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.kernels --only pointwise --seeds 3 --budget 80 > /tmp/pointwise.log 2>&1; echo "== pointwise rc=$?"; grep "norm_norm\|norm_add_norm\|MISMATCH" /tmp/pointwise.log | grep -v xla_ref | cut -c1-160
STEP="--preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 10"
timeout 150 python3 -m loopjax.bench.decode_step $STEP --out $OUT/h_new.json > /tmp/h_new.log 2>&1; echo "== h_new rc=$?"; grep " rows " /tmp/h_new.log | cut -c1-220
timeout 100 python3 -m loopjax.bench.cli huginn-0125 -C 8 8 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 80 --out $OUT/b_huginn.json > /tmp/b_huginn.log 2>&1; echo "== b_huginn rc=$?"; grep "burst on\|engine ready" /tmp/b_huginn.log | cut -c1-260
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -m loopjax.bench.decode_step $STEP --out $OUT/h_base.json > /tmp/h_base.log 2>&1; echo "== h_base rc=$?"; grep " rows " /tmp/h_base.log | cut -c1-220)
cd /tmp && tar czf $OUT/logs.tgz *.log
