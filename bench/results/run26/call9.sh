# Run 26 call 9 (tree 90665bc; fastapi, starlette, uvicorn, pydantic, opentelemetry-api carried
# as wheels in .whl/: the image has none of them; call 8 lacked opentelemetry-api, which
# fastapi 0.165 imports): burst-32 Ouro-1.4B over HTTP (`loopjax serve` + `loopjax bench --url`,
# streamed completions) against the same workload in-process, on one machine.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.server" || exit 3
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736"
python3 -m loopjax.cli serve ouro-1.4b --port 8011 $ENG > $OUT/serve.log 2>&1 &
SERVER=$!
python3 - $SERVER <<'PY' || { tail -5 $OUT/serve.log; exit 4; }
import os, sys, time, httpx
pid = int(sys.argv[1])
for _ in range(150):
    try:
        if httpx.get("http://127.0.0.1:8011/health", timeout=1).status_code == 200:
            print("server up"); sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server died")
    time.sleep(1)
sys.exit("server not up in 150 s")
PY
B="--workload burst -P 512 -O 128 --no-progress --max-seconds 60"
timeout 100 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 32 32 32 $B --out $OUT/http32.json > $OUT/http32.log 2>&1
echo "== http32 rc=$?"; grep -E "burst on|rror" $OUT/http32.log | cut -c1-250
kill $SERVER; wait $SERVER 2>/dev/null
grep -E "ready|warm" $OUT/serve.log | head -3
timeout 120 python3 -m loopjax.cli bench ouro-1.4b -C 32 32 32 $B $ENG --out $OUT/inproc32.json > $OUT/inproc32.log 2>&1
echo "== inproc32 rc=$?"; grep -E "engine ready|burst on" $OUT/inproc32.log | cut -c1-250
