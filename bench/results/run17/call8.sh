# Run 17 call 8: the persistent MLP kernel (kernels/persistent_mlp.py) on the device: results
# vs the XLA twin, then Ouro-1.4B MLP chains (triton / two_kernels / fused); and the swapped
# PDL kernel with its transposed in-kernel store (no XLA transpose) in the product chains.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m loopjax.bench.probes.persistent_mlp_check --rows 1,8,32 --out $OUT/pmlp.json > /tmp/pmlp.log 2>&1
echo "pmlp rc=$?"; grep -v Warning /tmp/pmlp.log | grep "rows\|Error\|error" | cut -c1-250 | head -30
timeout 150 python3 -m loopjax.bench.probes.persistent_mlp_check --rows 1,32 --checks 1 --iters 5 --arms triton,fused --trace /tmp/trc > /tmp/pmlp_trace.log 2>&1
echo "trace rc=$?"; grep -v Warning /tmp/pmlp_trace.log | grep "^device\|^gaps\|loopjax\|fusion\|µs/layer" | grep -v "kernel groups" | awk '!seen[$0]++' | cut -c1-160 | head -40
timeout 150 python3 -m loopjax.bench.probes.pdl_chain --rows 1,8,32 --arms triton,pdl@swap,pdl_off@swap > /tmp/chain.log 2>&1
echo "chain rc=$?"; grep -v Warning /tmp/chain.log | grep "µs/layer\|FAILED" | cut -c1-160
cd /tmp && tar czf $OUT/logs.tgz pmlp.log pmlp_trace.log chain.log
