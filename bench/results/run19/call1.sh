# Run 19 call 1: the Mosaic decode attention with several kv heads per program (one wave of
# resident programs at 32-128 rows): kernel sweep (checked against the ref), decode steps with
# 1 head per program vs the new default, burst-32 end to end; a prefill-attention probe.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.kernels --only sweep --iters 50 \
  --sweep-cases 16x512,32x512,64x512,128x512,32x640,32x2048,128x2048 \
  --sweep-mgpu "4,3,d,1;4,3,d,d;4,3,d,2;4,3,d,4;4,3,d,8;4,3,d,5;4,3,d,11" --out $OUT/sweep.json > /tmp/sweep.log 2>&1
echo "sweep rc=$?"; grep -v "must divide" /tmp/sweep.log | cut -c1-130
timeout 200 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto \
  --per-loop-rows 0 --context 512 --rows 32,64,128 --attn-heads 1,auto,1,auto --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep "rows " /tmp/steps.log | sed 's/  */ /g' | cut -c1-220
timeout 60 python3 bench/results/run19/prefill_attn_probe.py > /tmp/prefill.log 2>&1
echo "prefill probe rc=$?"; cat /tmp/prefill.log | grep -v Warning | tail -12
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 100 ouro-1.4b -C 32 32
cd /tmp && tar czf $OUT/logs.tgz *.log
