# Run 13 call 10b: call 10 again with the base as a plain copy of ff04857's files (the device's
# git has no commits past d1b3cd1): Huginn-0125 steps before and after add_norm_norm.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
here=$(pwd)
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --iters 10 --rows 8,1 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows " /tmp/$tag.log | cut -c1-200; }
cd base_ff04857 && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.kernels, loopjax.models.huginn as h; print('base', loopjax.kernels.__file__, hasattr(loopjax.layers, 'linear_add_norm_norm'))"
ds base 70
cd $here && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import loopjax.kernels, loopjax.layers; print('new', loopjax.kernels.__file__, hasattr(loopjax.layers, 'linear_add_norm_norm'))"
ds new 70
