#!/bin/bash
# Run 32 call 3: the session's final tree end to end on the GPU against the session's start
# (33a6158, shipped as _base/ and installed in turn): burst-32 Ouro-1.4B and burst-8
# Huginn-0125 in-process, alternating processes; then the final tree's server (wheels carried
# in .whl/) with --api-key: burst-32 over HTTP and the session's new request fields.
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
python3 -m loopjax.cli --version
LOOPJAX_API_KEY=k3y python3 -m loopjax.cli serve ouro-1.4b --port 8011 --max-context-len 1024 --kv-memory-bytes 68719476736 > /tmp/serve.log 2>&1 &
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
timeout 60 python3 -m loopjax.cli bench ouro-1.4b --api-key k3y --url http://127.0.0.1:8011 -C 32 32 32 --workload burst -P 512 -O 128 --no-progress > /tmp/http32.log 2>&1
echo "== burst-32 over HTTP rc=$?"; grep -E "burst on|rror" /tmp/http32.log | cut -c1-200
python3 - <<'PY'
import httpx
u, key = "http://127.0.0.1:8011", {"Authorization": "Bearer k3y"}
print("no key:", httpx.get(u + "/v1/models", timeout=10).status_code, "| version:", httpx.get(u + "/version").text)
cases = {"stop id": {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
         "allowed ids": {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0.8, "seed": 1,
                         "allowed_token_ids": [7, 11, 13]},
         "truncated": {"prompt": list(range(1, 2001)), "max_tokens": 2, "truncate_prompt_tokens": 16},
         "tools": {"prompt": [1, 2], "max_tokens": 2, "tools": [{"type": "function"}]}}
first = None
for name, body in cases.items():
    r = httpx.post(u + "/v1/completions", json=body, headers=key, timeout=60)
    c = r.json().get("choices", [{}])[0]
    if name == "stop id":
        first = c["token_ids"]
    print(f"{name}: {r.status_code} tokens={c.get('token_ids')} finish={c.get('finish_reason')} "
          f"stop_reason={c.get('stop_reason')} {r.text[:120] if r.status_code != 200 else ''}")
body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [first[3]]}
c = httpx.post(u + "/v1/completions", json=body, headers=key, timeout=60).json()["choices"][0]
print(f"stop at token 4: tokens={c['token_ids']} finish={c['finish_reason']} stop_reason={c['stop_reason']}")
print("health after:", httpx.get(u + "/health", timeout=5).status_code)
PY
kill $SERVER; wait $SERVER 2>/dev/null; echo "server exit $?"
