# Run 18 call 10: does the 64-row change (wqkv and w_gate_up streamed at 64 rows, SiLU*up and
# the norms' partials on Mosaic at 64) move burst-128? Two engines in one process: 'new' (the
# defaults) then 'old' (call 5's tables), each with two burst-128 runs.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 230 python3 - > /tmp/ab.log 2>&1 <<'PY'
import gc
from loopjax import matmul_ops as mo
from loopjax.bench import cli
new = dict(mo.STREAMING_MAX_ROWS), dict(mo.MOSAIC_ROWS)
old = ({**new[0], (2048, 6144): 32, (2048, 11264): 32},
       {**new[1], "linear_silu_mul": frozenset({8, 16, 32}), "linear_norm_add_norm": frozenset({8, 16, 32})})
for name, (streaming, mosaic) in (("new", new), ("old", old)):
    mo.STREAMING_MAX_ROWS, mo.MOSAIC_ROWS = streaming, mosaic
    print(f"== {name}", flush=True)
    cli.main(["ouro-1.4b", "-C", "128", "128", "--max-num-rows", "128", "--workload", "burst", "-P", "512",
              "-O", "128", "--max-context-len", "1024", "--kv-memory-bytes", "68719476736", "--no-progress",
              "--max-seconds", "100"])
    gc.collect()
PY
echo "ab rc=$?"; grep "^== \|burst on\|engine ready\|rror" /tmp/ab.log | cut -c1-240
cd /tmp && tar czf $OUT/logs.tgz ab.log
