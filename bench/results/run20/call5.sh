# Run 20 call 5 (tree with the warm-up's full collection): where burst-32's idle device time
# is now, over the whole burst (8 prefill + 128 decode steps) traced from its first step.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 330 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 128 -C 32 --max-context-len 1024 \
  --kv-memory-bytes 68719476736 --trace-steps 136 --trace-from start --out $OUT/prof > /tmp/prof.log 2>&1
echo "profile rc=$?"; cut -c1-150 /tmp/prof.log | grep -v "^ *$" | tail -60
