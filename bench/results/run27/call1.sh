# Run 27 call 1 (tree c65e074 + kernel_order.py): (a) traces of the Ouro-1.4B decode step at
# 1 / 8 / 32 rows, context 512, with each kernel's time and the idle gap before it per position
# in the layer application (wo's and w_down's partials told apart); (b) burst-128 over HTTP
# against in-process on one machine (never measured: run 26's call 8 failed on a wheel).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.server" || exit 3
timeout 200 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 10 --trace /tmp/tr --out $OUT/trace_steps.json > $OUT/trace.log 2>&1
echo "trace rc=$?"; grep " rows \|rror" $OUT/trace.log | cut -c1-200
for d in /tmp/tr/*; do echo "== $d"; python3 bench/results/run27/kernel_order.py $d | head -24; done
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736 --max-num-rows 128"
B="--workload burst -P 512 -O 128 --no-progress --max-seconds 60"
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
timeout 90 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 128 128 $B --out $OUT/http128.json > $OUT/http128.log 2>&1
echo "== http128 rc=$?"; grep -E "burst on|rror" $OUT/http128.log | cut -c1-250
kill $SERVER; wait $SERVER 2>/dev/null
grep -E "ready|warm" $OUT/serve.log | head -3
timeout 150 python3 -m loopjax.cli bench ouro-1.4b -C 128 128 $B $ENG --out $OUT/inproc128.json > $OUT/inproc128.log 2>&1
echo "== inproc128 rc=$?"; grep -E "engine ready|burst on" $OUT/inproc128.log | cut -c1-250
