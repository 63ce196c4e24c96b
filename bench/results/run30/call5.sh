# Run 30 call 5: the final serve path (the port bound before the engine is built, uvicorn.Server on that socket) on the GPU: burst-32 Ouro-1.4B over HTTP, window off, then lone requests.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.server" || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736"
B="--workload burst -P 512 -O 128 --no-progress --max-seconds 40"
for window in 0; do
  python3 -m loopjax.cli serve ouro-1.4b --port 8011 $ENG --admission-window-ms $window > $OUT/serve_w$window.log 2>&1 &
  SERVER=$!
  python3 - $SERVER <<'PY' || { tail -5 $OUT/serve_w$window.log; exit 4; }
import os, sys, time, httpx
pid = int(sys.argv[1])
for _ in range(150):
    try:
        if httpx.get("http://127.0.0.1:8011/health", timeout=1).status_code == 200:
            sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server died")
    time.sleep(0.5)
sys.exit("server not up in 75 s")
PY
  timeout 60 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 32 32 32 $B > $OUT/http32_w$window.log 2>&1
  echo "== window $window ms, burst-32 rc=$?"; grep -E "burst on|rror" $OUT/http32_w$window.log | cut -c1-200
  timeout 60 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 1 1 1 $B > $OUT/http1_w$window.log 2>&1
  echo "== window $window ms, lone requests rc=$?"; grep -E "burst on|rror" $OUT/http1_w$window.log | cut -c1-200
  start=$(date +%s); timeout 60 python3 -m loopjax.cli serve ouro-1.4b --port 8011 $ENG > $OUT/second.log 2>&1
  echo "a second server on the port: rc=$? after $(( $(date +%s) - start )) s"; tail -2 $OUT/second.log
  kill $SERVER; wait $SERVER 2>/dev/null; echo "server exit $?"; grep -E "serving on|rror" $OUT/serve_w$window.log | head -3
done
