#!/bin/bash
# Run 36 call 1 (session 29): the session's tree against its start (248c5f6, shipped as _base/ and
# installed in turn). Host-side changes only (the engine's per-step batch page tables, prompt
# checks, one SamplingParams copy per request; CLI / server / research-API fixes): (a) burst-32
# Ouro-1.4B in-process, alternating processes; (b) the new host-overhead bench on this host's CPU.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress"
inst() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
b() { tag=$1 dir=$2 secs=$3; shift 3
  inst $dir && (cd $dir && timeout $((secs + 20)) python3 -m loopjax.bench.cli "$@" $B --max-seconds $secs \
    --out $OUT/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "^burst|ready|compil|rror" /tmp/$tag.log | cut -c1-170 | head -8; }
b new1 . 90 ouro-1.4b -C 32 32 32
b base1 _base 90 ouro-1.4b -C 32 32 32
b new2 . 90 ouro-1.4b -C 32 32 32
b base2 _base 90 ouro-1.4b -C 32 32 32
inst .
timeout 150 python3 -m loopjax.bench.host_overhead --steps 60 --out $OUT/host_new.json > /tmp/host.log 2>&1
echo "== host_overhead rc=$?"; tail -20 /tmp/host.log
