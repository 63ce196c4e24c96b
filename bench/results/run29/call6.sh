# Run 29 call 6: the qkv + RoPE kernel's own time (profiler trace, no chain overhead) at 48
# programs of 512 KB (Ouro-1.4B), 20 of 512 KB, 24 of 256 KB and 12 of 128 KB; 1 and 32 rows.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 550 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1,32 --arms mgpu --iters 10 \
  --heads 16:16,16:2,8:8,4:4 --trace /tmp/tr6 --out $OUT/call6.json 2>&1 \
  | grep -E "^rows|loopjax_streaming_matmul_rope_mgpu|^device|^gaps" | cut -c1-150
