# Run 29 call 3: is Ouro's qkv + RoPE product bound by its program count? The Mosaic kernel
# (one program per head) and the Triton one at K = 2,048 with 16 q heads and 16 / 8 / 4 / 2 k, v
# heads (48 / 32 / 24 / 20 Mosaic programs of 512 KB each; 25 / 17 / 13 / 10 MB), 1, 8, 32 rows.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1,8,32 --arms mgpu,triton \
  --kv-heads 16,8,4,2 --out $OUT/call3.json 2>&1 | grep -vE "^(WARNING|I0|W0)"
