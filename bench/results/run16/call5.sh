# Run 16 call 5 (tree 7dca24e+: the greedy decode executable and the 16-bit sort merged):
# greedy requests' tokens with the greedy vs the full executable; decode steps greedy vs
# top-p; end to end with warm-up (4 more executables).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
timeout 90 python3 -m loopjax.bench.probes.greedy_invariance --preset ouro-1.4b > /tmp/inv.log 2>&1; echo "== inv rc=$?"; tail -2 /tmp/inv.log | cut -c1-250
timeout 130 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32,128 --sampled-case --iters 20 --out $OUT/o_steps.json > /tmp/o_steps.log 2>&1; echo "== o_steps rc=$?"; grep " rows " /tmp/o_steps.log | cut -c1-230
bc b_ouro 80 ouro-1.4b -C 32 32
bc b_ouro128 75 ouro-1.4b -C 128 --max-num-rows 128
bc b_huginn 110 huginn-0125 -C 8 8
cd /tmp && tar czf $OUT/logs.tgz *.log
