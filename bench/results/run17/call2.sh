# Run 17 call 2: XLA's own PDL switches: their names in the CUDA plugin, and the Ouro-1.4B
# decode step (1 and 32 rows, context 512) with each set true / false, against the default.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
so=$(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))")/jax_plugins
plugin=$(find $so -name "xla_cuda_plugin.so" | head -1)
flags=$(strings $plugin | grep -o "xla_[a-z0-9_]*pdl[a-z0-9_]*" | sort -u)
echo "flags: $flags"
strings $plugin | grep -i -B3 -A3 "Enable PDL (Programmatic\|Enable use of PDL launch" | head -30
step() { tag=$1; shift
  XLA_FLAGS="$*" timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 1,32 --iters 20 --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? XLA_FLAGS=$*"; grep " rows \|rror" /tmp/$tag.log | cut -c1-200; }
step base ""
i=0; for f in $flags; do i=$((i+1)); step on$i --$f=true; done
i=0; for f in $flags; do i=$((i+1)); step off$i --$f=false; done
step base2 ""
cd /tmp && tar czf $OUT/logs.tgz *.log
