# Run 21 call 1 (tree 4a1fcce): the prefill's RoPE + K/V write in one kernel
# (kernels/rope_kv_write.py). Bitwise on the GPU against the model's RoPE + XLA's scatter;
# prefill steps (4 x 512, traced) and burst-32, each A/B in this call: 'base' is the same tree
# with attention_backend.rope_write_fn returning None (the model's RoPE, v's slice and the
# write kernel, as before the change).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
run() { tag=$1 arm=$2 mod=$3; shift 3
  timeout ${LIMIT:-150} python3 -c "
import sys
import loopjax.attention_backend as ab
if '$arm' == 'base':
    ab.rope_write_fn = lambda attend, layout: None
import importlib
sys.argv = ['$mod'] + sys.argv[1:]
sys.exit(importlib.import_module('$mod').main())" "$@" > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; }
LIMIT=120 run kernels new loopjax.bench.kernels --only kv_write
grep -E "kv_write|rope_write" /tmp/kernels.log | cut -c1-120
PF="--preset ouro-1.4b,huginn-0125 --shapes 4x512 --huginn-shapes 4x512 --backend pallas --startup-backends none --iters 10"
LIMIT=170 run pf_new new loopjax.bench.prefill $PF --trace /tmp/tr_new --out $OUT/prefill_new.json
LIMIT=170 run pf_base base loopjax.bench.prefill $PF --trace /tmp/tr_base --out $OUT/prefill_base.json
for t in pf_new pf_base; do echo "-- $t"; grep -iE "ms|rope|write|fusion|concat|slice" /tmp/$t.log | head -40 | cut -c1-160; done
B="ouro-1.4b -C 32 32 32 --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
for i in 1 2; do
  for arm in new base; do
    LIMIT=110 run b_${arm}$i $arm loopjax.bench.cli $B --out $OUT/b_${arm}$i.json
    grep "burst on" /tmp/b_${arm}$i.log | cut -c40-150
  done
done
cd /tmp && tar czf $OUT/logs.tgz *.log
