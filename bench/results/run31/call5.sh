#!/bin/bash
# Run 31 call 5: burst-32 over HTTP, the final tree against 85bdc6d (_base/), one server
# process each on the same machine (call 4 measured the new tree alone over HTTP: 2,691-2,760).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
for arm in new base; do
  dir=.; [ $arm = base ] && dir=_base
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
  (cd $dir && exec python3 -m loopjax.cli serve ouro-1.4b --port 8011 --max-context-len 1024 --kv-memory-bytes 68719476736 > /tmp/serve_$arm.log 2>&1) &
  SERVER=$!
  python3 -c "
import time, httpx, sys
for _ in range(160):
    try:
        if httpx.get('http://127.0.0.1:8011/health', timeout=1).status_code == 200: sys.exit(0)
    except Exception: pass
    time.sleep(0.5)
sys.exit('not up')" || { tail -3 /tmp/serve_$arm.log; }
  (cd $dir && timeout 50 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 32 32 32 --workload burst -P 512 -O 128 --no-progress > /tmp/http_$arm.log 2>&1)
  echo "== $arm rc=$?"; grep -E "burst on|rror" /tmp/http_$arm.log | cut -c1-190
  kill $SERVER; wait $SERVER 2>/dev/null; sleep 2
done
