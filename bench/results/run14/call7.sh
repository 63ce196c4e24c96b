# Run 14 call 7: the session's defaults (the K/V write kernel, RoPE in the qkv product, the host
# step changes): Ouro-1.4B steps, bursts (32, 128, one request), Huginn-0125 burst-8.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
timeout 140 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512,2048 --rows 1,8,32,128 --iters 20 --out $OUT/o_steps.json > /tmp/o_steps.log 2>&1; echo "== o_steps rc=$?"; grep " rows " /tmp/o_steps.log | cut -c1-200
bc b_ouro 150 ouro-1.4b -C 32 32 128 --max-num-rows 128
bc b_ouro1 60 ouro-1.4b -C 1
bc b_huginn 110 huginn-0125 -C 8
cd /tmp && tar czf $OUT/logs.tgz *.log
