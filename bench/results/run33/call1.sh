#!/bin/bash
# Run 33 call 1 (session 26): (a) the session's tree end to end against its start (fa35984,
# shipped as _base/ and installed in turn): burst-32 Ouro-1.4B and burst-8 Huginn-0125
# in-process, alternating processes; (b) the step-failure path on the H200: a failed read
# injected into a warm Ouro-1.4B engine with a 64 GiB KV pool (is the old pool freed before the
# new one is allocated?), then the same greedy requests as before the failure.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
b() { tag=$1 dir=$2 secs=$3; shift 3
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 &&
   timeout $((secs + 20)) python3 -m loopjax.bench.cli "$@" $B --max-seconds $secs --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|rror" /tmp/$tag.log | cut -c1-170 | head -5; }
b new_1 . 60 ouro-1.4b -C 32 32 32
b base_1 _base 60 ouro-1.4b -C 32 32 32
b new_2 . 60 ouro-1.4b -C 32 32 32
b base_2 _base 60 ouro-1.4b -C 32 32 32
b new_h . 150 huginn-0125 -C 8
b base_h _base 150 huginn-0125 -C 8
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 - <<'PY' 2>&1 | grep -v Warning | tail -20
import time
import jax
import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.request import StepFailedError
from loopjax.sampling_params import SamplingParams

model = loopjax.load("ouro-1.4b")
t = time.perf_counter()
engine = Engine(model, EngineConfig(max_context_len=1024, kv_memory_bytes=64 << 30, verbose=False))
compiled = engine.stats()["compilations"]
print(f"warm-up {time.perf_counter() - t:.1f} s; device memory in use "
      f"{jax.devices()[0].memory_stats()['bytes_in_use'] / 2**30:.1f} GiB")
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
prompts = {f"r{i}": [(7 * i + j) % 1000 + 1 for j in range(40 + i)] for i in range(8)}

def run(tag):
    for rid, p in prompts.items():
        engine.add_request(p, params, f"{tag}{rid}")
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id[len(tag):], o.token_ids) for o in engine.step() if o.finished)
    return done

before = run("a")
for rid, p in prompts.items():
    engine.add_request(p, params, f"b{rid}")
for _ in range(4):
    engine.step()
read = engine.runner.read
def broken(pending):
    engine.runner.read = read
    raise RuntimeError("INTERNAL: injected device error")
engine.runner.read = broken
t = time.perf_counter()
try:
    engine.step()
    print("FAIL: no error")
except StepFailedError as e:
    print(f"StepFailedError in {time.perf_counter() - t:.2f} s: {e} | lost {len(e.request_ids)} "
          f"recovered={e.recovered}")
aborted = [o for o in engine.step() if o.finished]
print(f"aborted reported: {len(aborted)} {sorted({o.finish_reason for o in aborted})}; device memory in use "
      f"{jax.devices()[0].memory_stats()['bytes_in_use'] / 2**30:.1f} GiB")
after = run("c")
stats = engine.stats()
print(f"after == before: {after == before}; pages free {stats['pages_free']} of {stats['pages_total']}; "
      f"compilations after warm-up {stats['compilations'] - compiled}")
PY
echo "== step failure rc=$?"
