# Run 27 call 7 (tree 56d6836; wheels carried as in run 26): burst-128 Ouro-1.4B over HTTP and
# in-process on ONE machine (call 1 had HTTP only; call 2's in-process ran on another machine).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.server" || exit 3
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736 --max-num-rows 128"
B="--workload burst -P 512 -O 128 --no-progress"
timeout 140 python3 -m loopjax.cli bench ouro-1.4b -C 128 128 $B $ENG --max-seconds 130 --out $OUT/inproc128.json > $OUT/inproc128.log 2>&1
echo "== inproc128 rc=$?"; grep -E "engine ready|burst on" $OUT/inproc128.log | sed -E 's/ \| prefix cache off//; s/ \| warm-up.*//' | cut -c1-200
python3 -m loopjax.cli serve ouro-1.4b --port 8011 $ENG > $OUT/serve.log 2>&1 &
SERVER=$!
python3 - $SERVER <<'PY' || { tail -5 $OUT/serve.log; exit 4; }
import os, sys, time, httpx
pid = int(sys.argv[1])
for _ in range(300):
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
sys.exit("server not up in 150 s")
PY
timeout 60 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 128 128 $B --max-seconds 50 --out $OUT/http128.json > $OUT/http128.log 2>&1
echo "== http128 rc=$?"; grep -E "burst on|rror" $OUT/http128.log | sed -E 's/ \| prefix cache off//' | cut -c1-200
kill $SERVER; wait $SERVER 2>/dev/null
