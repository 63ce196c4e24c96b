# Run 18 call 2: the Mosaic qkv + RoPE kernel with a 2-program cluster per head (each streams
# one half of the head and trades it through distributed shared memory: 96 programs) against
# one program per head (block_k 128 now the default) and the Triton kernel; chain + traces.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 300 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 8,16,32,64 --arms triton,mgpu,mgpu@c,mgpu@ck64,mgpu@ct4 --trace /tmp/tr --out $OUT/chain.json > /tmp/chain.log 2>&1
echo "chain rc=$?"; grep "^rows\|rror" /tmp/chain.log | cut -c1-200
grep "^rows\|loopjax_streaming_matmul_rope" /tmp/chain.log | cut -c1-120 | head -90
cd /tmp && tar czf $OUT/logs.tgz chain.log
