# Run 24 call 1. (a) Huginn-0125 prefill steps with lm_head over the sampled tokens only
# (8843875) against the tree before it (46b6ed0, shipped as _base/), alternating new / base /
# new, each arm in its own process after installing its tree. (b) loopjax bench's new sampling
# flags on the GPU: Ouro-1.4B burst-32 greedy, then drawing with penalties through the flags.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
P="--preset huginn-0125 --huginn-shapes 4x512,1x2048 --backend pallas --startup-backends none --iters 10"
pf() { tag=$1 dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -m loopjax.bench.prefill $P --out /tmp/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "huginn-0125 +pallas" /tmp/$tag.log | cut -c1-170; }
pf prefill_new1 .
pf prefill_base1 _base
pf prefill_new2 .
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="ouro-1.4b --workload burst -P 512 -O 128 -C 32 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
bu() { tag=$1; shift
  timeout 120 python3 -m loopjax.bench.cli $B "$@" --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "engine ready|burst on" /tmp/$tag.log | cut -c1-260; }
bu burst_greedy
bu burst_penalized --temperature 0.8 --top-p 0.9 --repetition-penalty 1.1 --presence-penalty 0.5 --frequency-penalty 0.3 --sampling-seed 1
cd /tmp && tar czf $OUT/call1.tgz prefill_* burst_*
