# Run 30 call 6: is the new serve path (a8bb2e3 -> 1aa82e0: the port bound before the engine is
# built, uvicorn.Server on that socket) as fast as uvicorn.run? burst-32 Ouro-1.4B over HTTP,
# the two trees alternating on one machine (_base = a8bb2e3), one server process each.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site || exit
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736"
B="--workload burst -P 512 -O 128 --no-progress --max-seconds 40"
for arm in new base new base; do
  dir=.; [ $arm = base ] && dir=_base
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
  (cd $dir && exec python3 -m loopjax.cli serve ouro-1.4b --port 8011 $ENG > /tmp/serve_$arm.log 2>&1) &
  SERVER=$!
  python3 - <<'PY' || { tail -5 /tmp/serve_$arm.log; exit 4; }
import sys, time, httpx
for _ in range(150):
    try:
        if httpx.get("http://127.0.0.1:8011/health", timeout=1).status_code == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit("server not up in 75 s")
PY
  timeout 60 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 32 32 32 $B > /tmp/http_$arm.log 2>&1
  echo "== $arm rc=$?"; grep -E "burst on|rror" /tmp/http_$arm.log | cut -c1-160
  kill $SERVER; wait $SERVER 2>/dev/null; sleep 2
done
