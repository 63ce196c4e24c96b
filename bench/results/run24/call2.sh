# Run 24 call 2: Huginn-0125 with lm_head over the sampled tokens only (8843875) against the
# tree before it (46b6ed0, _base/), each arm in its own process after installing its tree:
# (a) burst-8 end to end; (b) requests with a KL exit criterion in select mode, whose prefill
# runs the coda on every checked loop (bench/results/run24/adaptive_prefill.py).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
B="huginn-0125 --workload burst -P 512 -O 128 -C 8 8 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
SCRIPT=$(pwd)/bench/results/run24/adaptive_prefill.py
arm() { tag=$1 dir=$2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    && timeout 150 python3 -m loopjax.bench.cli $B --out /tmp/burst_$tag.json > /tmp/burst_$tag.log 2>&1; \
    echo "== burst $tag rc=$?"; grep -E "engine ready|burst on" /tmp/burst_$tag.log | cut -c1-230; \
    timeout 200 python3 $SCRIPT > /tmp/adaptive_$tag.log 2>&1; echo "== adaptive $tag rc=$?"; tail -3 /tmp/adaptive_$tag.log | cut -c1-300); }
arm new .
arm base _base
cd /tmp && tar czf $OUT/call2.tgz burst_* adaptive_*
