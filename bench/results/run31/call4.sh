#!/bin/bash
# Run 31 call 4: the session's final tree end to end on the GPU against the session's start
# (85bdc6d, shipped as _base/ and installed in turn): burst-32 Ouro-1.4B and burst-8
# Huginn-0125 in-process, alternating processes; then the server (wheels carried in .whl/):
# burst-32 over HTTP and a few of the session's request fixes.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
b() { tag=$1 dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout 140 python3 -m loopjax.bench.cli "$@" $B --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|rror" /tmp/$tag.log | cut -c1-170 | head -5; }
b new_1 . ouro-1.4b -C 32 32 32
b base_1 _base ouro-1.4b -C 32 32 32
b new_2 . ouro-1.4b -C 32 32 32
b base_2 _base ouro-1.4b -C 32 32 32
b new_h . huginn-0125 -C 8 8
b base_h _base huginn-0125 -C 8 8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m loopjax.cli serve ouro-1.4b --port 8011 --max-context-len 1024 --kv-memory-bytes 68719476736 > /tmp/serve.log 2>&1 &
SERVER=$!
python3 - $SERVER <<'PY' || { tail -5 /tmp/serve.log; exit 4; }
import os, sys, time, httpx
pid = int(sys.argv[1])
for _ in range(180):
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
sys.exit("server not up in 90 s")
PY
timeout 60 python3 -m loopjax.cli bench ouro-1.4b --url http://127.0.0.1:8011 -C 32 32 32 --workload burst -P 512 -O 128 --no-progress > /tmp/http32.log 2>&1
echo "== burst-32 over HTTP rc=$?"; grep -E "burst on|rror" /tmp/http32.log | cut -c1-200
python3 - <<'PY'
import httpx
u = "http://127.0.0.1:8011/v1/completions"
cases = {"plain": {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "logprobs": 2},
         "echo as a string": {"prompt": [1, 2, 3], "max_tokens": 2, "echo": "false"},
         "deep JSON": None}
for name, body in cases.items():
    r = (httpx.post(u, json=body, timeout=30) if body is not None else
         httpx.post(u, content="[" * 100000 + "]" * 100000, headers={"content-type": "application/json"}, timeout=30))
    print(f"{name}: {r.status_code} {r.text[:160]}")
r = httpx.post("http://127.0.0.1:8011/v1/chat/completions", timeout=30, json={"max_tokens": 2, "messages": [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
print(f"chat image part: {r.status_code} {r.text[:160]}")
print("health after:", httpx.get("http://127.0.0.1:8011/health", timeout=5).status_code)
PY
kill $SERVER; wait $SERVER 2>/dev/null; echo "server exit $?"
