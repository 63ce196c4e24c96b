# Run 16 call 8: the Ouro-1.4B 32-row step with the qkv + RoPE kernel's block_k / warps /
# stages varied in the step itself (bench/probes/rope_in_step.py; block_n 32 as today).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 280 python3 -m loopjax.bench.probes.rope_in_step --rows 32 --configs k128w4s4,k128w4s6,k64w4s8,k256w4s3,k128w8s4,k64w4s4,k128w4s4 > /tmp/rope_step.log 2>&1; echo "== rope_step rc=$?"; grep "== rope\| rows " /tmp/rope_step.log | cut -c1-230
cd /tmp && tar czf $OUT/logs.tgz *.log
