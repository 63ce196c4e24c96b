# Run 16 call 4 (tree after 5c73992: matmul_rope --wide): Ouro-1.4B's qkv + RoPE kernel over
# block_k x stages x warps per block_n (the 32-row step's worst product: 12.5 us for 25 MB);
# the 32-row step with 2 context splits in the decode attention.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.matmul_rope --rows 32 --block-n 16,32 --wide > /tmp/rope32.log 2>&1; echo "== rope32 rc=$?"; grep "rope n\|xla\|copy rate" /tmp/rope32.log | sort -t' ' -k1,1 | cut -c1-150
timeout 200 python3 -m loopjax.bench.matmul_rope --rows 1,8 --block-n 32,64 --wide > /tmp/rope18.log 2>&1; echo "== rope18 rc=$?"; grep "rope n\|xla" /tmp/rope18.log | cut -c1-150
timeout 120 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 32 --attn-splits auto,2 --iters 20 --out $OUT/o32_splits.json > /tmp/o32_splits.log 2>&1; echo "== o32_splits rc=$?"; grep " rows " /tmp/o32_splits.log | cut -c1-230
cd /tmp && tar czf $OUT/logs.tgz *.log
