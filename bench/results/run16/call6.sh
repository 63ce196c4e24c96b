# Run 16 call 6 (tree HEAD: Huginn's adapter in two halves, e's half once per step; HEAD~1
# shipped as _base/): Huginn-0125 steps new vs base, burst-8; Ouro-1.4B burst-128 twice (its
# spread: call 5 gave 3,927 tok/s against run 15's 4,176).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
STEP="--preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 10"
timeout 150 python3 -m loopjax.bench.decode_step $STEP --out $OUT/h_new.json > /tmp/h_new.log 2>&1; echo "== h_new rc=$?"; grep " rows " /tmp/h_new.log | cut -c1-220
bc b_huginn 115 huginn-0125 -C 8 8
bc b_ouro128 100 ouro-1.4b -C 128 128 --max-num-rows 128
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -m loopjax.bench.decode_step $STEP --out $OUT/h_base.json > /tmp/h_base.log 2>&1; echo "== h_base rc=$?"; grep " rows " /tmp/h_base.log | cut -c1-220)
cd /tmp && tar czf $OUT/logs.tgz *.log
