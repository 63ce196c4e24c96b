# Run 29 call 4: Ouro-1.4B's wqkv streamed by more programs. The qkv + RoPE kernel (48 programs,
# one per head) against the plain Mosaic product without the RoPE (x as wgmma's A operand) in
# 64- and 32-column strips (96 / 192 programs, no K split) and its default tiling.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 550 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1,8,32 \
  --arms mgpu,mm,mm@n64k128t4s1,mm@n64k64t6s1,mm@n32k128t4s1,mm@n32k128t6s1,mm@n32k64t8s1 \
  --out $OUT/call4.json 2>&1 | grep -vE "^(WARNING|I0|W0)"
