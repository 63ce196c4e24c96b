# Run 15 call 2: call 1's block sizes in TUNED (kernels/streaming_config.py) with the sampler's
# draw under a cond from 8-row buckets (this tree) vs the same tree without the cond (_nocond/:
# DRAW_COND_MIN_ROWS = 1 << 30): Ouro-1.4B steps (greedy and all-top-p rows), Ouro-1.4B
# burst-32 and Huginn-0125 burst-8 end to end (greedy, as `loopjax bench` runs them).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
steps() { tag=$1; shift
  timeout 100 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 20 --sampled-case --out $OUT/$tag.json "$@" > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows \|rror" /tmp/$tag.log | cut -c1-220; }
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
steps o_cond
bc b_ouro_cond 75 ouro-1.4b -C 32 32
bc b_huginn_cond 80 huginn-0125 -C 8
cd _nocond && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
steps o_nocond
bc b_ouro_nocond 75 ouro-1.4b -C 32 32
bc b_huginn_nocond 80 huginn-0125 -C 8
cd /tmp && tar czf $OUT/logs.tgz *.log
