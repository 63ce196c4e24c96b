# Run 17 call 1: Programmatic Dependent Launch probe (bench/probes/pdl_chain.py), with and
# without XLA command buffers; which PDL switches the CUDA plugin knows.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
so=$(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))")
for f in $(find $so/jax_plugins $so/jaxlib -name "*.so" 2>/dev/null); do
  strings $f | grep -i "pdl\|griddepcontrol\|programmatic" | sort -u | head -20 | sed "s|^|$(basename $f): |"; done
timeout 240 python3 -m loopjax.bench.probes.pdl_chain --out $OUT/default.json 2>&1 | grep -v Warning
echo "== no command buffers"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python3 -m loopjax.bench.probes.pdl_chain --arms triton,pdl_off,pdl --out $OUT/nocmdbuf.json 2>&1 | grep -v Warning
