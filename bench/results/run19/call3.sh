# Run 19 call 3: the H200's compute capability as jax reports it (the Mosaic kernels' guard);
# Mosaic decode attention slots / pages per block / kv heads per program at 32 and 64 rows,
# context 576 (burst-32's mean): kernel sweep (checked) and decode steps; burst-32 again.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "
import jax; from loopjax.kernels._common import mosaic_gpu_problem
print([(d.device_kind, d.compute_capability) for d in jax.devices()], 'mosaic problem:', mosaic_gpu_problem())"
timeout 80 python3 -m loopjax.bench.kernels --only sweep --iters 50 --models ouro-1.4b --sweep-cases 32x576,64x576 \
  --sweep-mgpu "4,3,d,1;4,3,d,d;4,4,d,2;4,6,d,4;8,3,d,4;8,2,d,2;4,2,d,2;8,3,d,2;4,3,d,4" --out $OUT/sweep.json > /tmp/sweep.log 2>&1
echo "sweep rc=$?"; grep "sweep decode" /tmp/sweep.log | cut -c1-130
timeout 170 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto \
  --per-loop-rows 0 --context 576 --rows 32 --attn-heads auto,4 --attn-stages auto,6 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep "rows " /tmp/steps.log | sed 's/  */ /g' | cut -c1-220
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 100 ouro-1.4b -C 32 32 32
cd /tmp && tar czf $OUT/logs.tgz *.log
