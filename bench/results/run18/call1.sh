# Run 18 call 1: Ouro-1.4B's qkv + RoPE on the new Mosaic GPU kernel (one program per head)
# against the Triton kernel: the 24-layer x 4-loop chain with traces (per-kernel µs), the
# results against the XLA twin, then the decode step with and without it (context 512).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 8,16,32,64 --arms triton,mgpu,mgpu@t4,mgpu@t6,mgpu@k128,mgpu@k128t3 --trace /tmp/tr --out $OUT/chain.json > /tmp/chain.log 2>&1
echo "chain rc=$?"; grep "^rows\|rror" /tmp/chain.log | cut -c1-200
grep -n "^rows\|rope" /tmp/chain.log | grep -v "^.*kernel groups" | cut -c1-160 | head -80
timeout 300 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rope-rows 'none;8,16,32,64' --per-loop-rows 0 --context 512 --rows 8,16,32,64 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-220
cd /tmp && tar czf $OUT/logs.tgz chain.log steps.log
