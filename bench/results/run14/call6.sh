# Run 14 call 6 (tree 3ee31a5): the qkv product with RoPE in its epilogue (kernels/streaming_matmul_rope.py)
# against the plain streaming product + XLA RoPE per product, then the Ouro-1.4B decode step with it.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.matmul_rope > /tmp/matmul_rope.log 2>&1
echo "== matmul_rope rc=$?"; grep -v "^\s*$\|cuda_timer" /tmp/matmul_rope.log | cut -c1-170 | tail -25
timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,8,32 --iters 20 --out $OUT/o_rope.json > /tmp/o_rope.log 2>&1
echo "== o_rope rc=$?"; grep " rows \|rror" /tmp/o_rope.log | cut -c1-200
cd /tmp && tar czf $OUT/logs.tgz *.log
