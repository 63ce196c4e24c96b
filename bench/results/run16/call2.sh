# Run 16 call 2 (tree 4bbfb2d + the two probes): the sampler's cost at decode rows and a
# 16-bit sort; the Triton prefill attention's block sizes at 4 x 512 tokens.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.probes.sampler_probe > /tmp/sampler.log 2>&1; echo "== sampler rc=$?"; grep -v "^W0\|^I0" /tmp/sampler.log | cut -c1-260 | tail -8
timeout 300 python3 -m loopjax.bench.probes.prefill_attn_sweep > /tmp/prefill_sweep.log 2>&1; echo "== prefill rc=$?"; grep "us \|ERROR" /tmp/prefill_sweep.log | cut -c1-200
cd /tmp && tar czf $OUT/logs.tgz *.log
