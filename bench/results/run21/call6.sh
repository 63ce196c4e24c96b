# Run 21 call 6 (tree of this commit): Huginn-0125's decode step with its q/k RoPE and K/V write
# in kernels/rope_kv_write.py, then the Mosaic attention alone ('new'), against the model's RoPE
# fusions, v's slice and the Mosaic write-and-attend kernel ('base': the same tree with
# rope_write_fn's decode route off). 8 rows, context 512, pipelined step time.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
STEP="--preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 8 --iters 20"
ds() { tag=$1 arm=$2
  timeout 95 python3 -c "
import sys
import loopjax.attention_backend as ab
if '$arm' == 'base':
    orig = ab.rope_write_fn
    ab.rope_write_fn = lambda attend, layout, interleaved: orig(attend, layout, False)
from loopjax.bench.decode_step import main
sys.argv = ['decode_step'] + sys.argv[1:]
main()" $STEP --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E " rows |rope_write|error" /tmp/$tag.log | cut -c1-200; }
ds new new
ds base base
cd /tmp && tar czf $OUT/call6.tgz *.log *.json
