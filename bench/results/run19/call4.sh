# Run 19 call 4: where burst-32's time goes from its first step: host stages per step kind and
# a device trace of its first 16 steps (the 8 prefill steps and the decode steps between them).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 128 -C 32 --max-context-len 1024 \
  --kv-memory-bytes 68719476736 --trace-steps 16 --trace-from start --out $OUT/prof > /tmp/prof.log 2>&1
echo "profile rc=$?"; cut -c1-150 /tmp/prof.log | grep -v "^ *$" | tail -70
