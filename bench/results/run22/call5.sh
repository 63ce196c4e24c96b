# Run 22 call 5 (tree with runner.compile_order): the warm-up lowers its likely longest compiles
# first: Huginn-0125 again (calls 3-4 ran on another machine). (prefill steps, most tokens first, then decode steps). A/B in alternating processes:
# 'base' is the same tree with compile_order a constant (the old order: decode steps, then
# prefill steps by tokens ascending). One burst each, for the warm-up's time.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
run() { tag=$1 arm=$2; shift 2
  timeout 150 python3 -c "
import sys
import loopjax.runner as runner
if '$arm' == 'base':
    runner.compile_order = lambda step: 0
from loopjax.bench import cli
sys.argv = ['loopjax.bench.cli'] + sys.argv[1:]
cli.main()" "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "engine ready|burst on" /tmp/$tag.log | cut -c1-120; }
run h_new5 new huginn-0125 -C 8
run h_base5 base huginn-0125 -C 8
run h_new6 new huginn-0125 -C 8
run h_base6 base huginn-0125 -C 8
cd /tmp && tar czf $OUT/call5.tgz h_*.*
