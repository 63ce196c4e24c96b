# Run 20 call 6: does the warm-up's full collection help burst-32 too? A/B in one call, two
# processes per arm, alternated: 'new' as committed, 'old' with Runner.warmup's gc.collect()
# replaced by a no-op (the tree before it, otherwise the same).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ARGS="ouro-1.4b -C 32 32 32 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
arm() { tag=$1 patch=$2
  timeout 110 python3 -c "
import sys, types
import loopjax.runner as runner
if '$patch' == 'old':
    runner.gc = types.SimpleNamespace(collect=lambda: 0)
from loopjax.bench.cli import main
sys.argv = ['loopjax-bench'] + sys.argv[1:]
sys.exit(main())" $ARGS --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep "burst on" /tmp/$tag.log | cut -c40-150; }
arm new1 new
arm old1 old
arm new2 new
arm old2 old
cd /tmp && tar czf $OUT/logs.tgz *.log
