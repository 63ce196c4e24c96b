# Run 29 call 5: the qkv + RoPE kernel's time against each program's bytes: K = 2,048 (16 q
# heads) and K = 1,024 (8 q heads) / 512 (4 q heads): 512 / 256 / 128 KB per program.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 550 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1,8,32 --arms mgpu \
  --heads 16:16,16:2,8:8,8:4,8:2,4:4 --out $OUT/call5.json 2>&1 | grep -vE "^(WARNING|I0|W0)"
