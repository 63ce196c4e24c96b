# Run 25 call 6. End to end on the session's tree (0d49585): Ouro-1.4B burst-32 (three bursts)
# and burst-128 (two), Huginn-0125 burst-8 (two), the defaults (max_logprobs now 20).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
bu() { tag=$1; shift
  timeout 150 python3 -m loopjax.bench.cli "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "engine ready|burst on" /tmp/$tag.log | cut -c1-250; }
bu burst32 ouro-1.4b -C 32 32 32
bu burst128 ouro-1.4b -C 128 128 --max-num-rows 128
bu huginn8 huginn-0125 -C 8 8
cd /tmp && tar czf $OUT/call6.tgz burst32.* burst128.* huginn8.*
