# Run 19 call 2: kv heads per program for Huginn-0125 (kernel sweep, checked; decode steps at
# 32 rows); bursts end to end with the first decode waiting for the prefill share (scheduler),
# and burst-32 with 4,096-token prefill steps as an arm.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 75 python3 -m loopjax.bench.kernels --only sweep --iters 50 --models huginn-0125 \
  --sweep-cases 32x512,16x512,32x2048,128x512,64x512 --sweep-mgpu "4,3,d,1;4,3,d,d;4,3,d,5" --out $OUT/sweep.json > /tmp/sweep.log 2>&1
echo "sweep rc=$?"; grep -v "must divide" /tmp/sweep.log | cut -c1-130
timeout 170 python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto \
  --per-loop-rows 0 --context 512 --rows 32 --attn-heads 1,auto,1,auto --iters 10 --out $OUT/steps_huginn.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep "rows " /tmp/steps.log | sed 's/  */ /g' | cut -c1-220
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 100 ouro-1.4b -C 32 32 32
bc b_ouro_p4096 100 ouro-1.4b -C 32 32 32 --max-prefill-tokens 4096
bc b_ouro128 100 ouro-1.4b -C 128 128 --max-num-rows 128
cd /tmp && tar czf $OUT/logs.tgz *.log
