# Run 20 call 3: why is burst-128's first burst in a process sometimes slow (run 19: 3,808 and
# 4,242; run 20 call 2: 3,923 then 4,204)? Three bursts per engine, twice: as is, and with
# Python's garbage collector off for the whole process (the engine thread and the in-process
# client share the GIL; a collection over the first burst's new objects would stall both).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ARGS="ouro-1.4b -C 128 128 128 --max-num-rows 128 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 110"
timeout 130 python3 -m loopjax.bench.cli $ARGS --out $OUT/b128.json > /tmp/b128.log 2>&1
echo "== default rc=$?"; grep "burst on\|engine ready" /tmp/b128.log | cut -c1-230
timeout 130 python3 -c "
import gc, sys; gc.disable()
from loopjax.bench.cli import main
sys.argv = ['loopjax-bench'] + sys.argv[1:]
sys.exit(main())" $ARGS --out $OUT/b128_nogc.json > /tmp/b128_nogc.log 2>&1
echo "== gc off rc=$?"; grep "burst on\|engine ready" /tmp/b128_nogc.log | cut -c1-230
cd /tmp && tar czf $OUT/logs.tgz *.log
