# Run 29 call 7: Ouro-1.4B's qkv + RoPE kernel with each head's K range split over a 2-program
# cluster (k_splits=2: 96 programs of 256 KB; split 1 hands its fp32 halves to split 0 through
# distributed shared memory) against one program per head: q, k, v against the XLA twin, and
# the kernels' own times from a trace.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 550 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1,8,32,64 --arms mgpu,mgpu@c2 --iters 10 \
  --trace /tmp/tr7 --out $OUT/call7.json 2>&1 \
  | grep -E "^rows|loopjax_streaming_matmul_rope_mgpu|rror" | awk '!seen[$0]++' | cut -c1-150
