# Run 18 call 8 (final defaults: Mosaic qkv + RoPE at 1-64 rows, SiLU*up and the norms'
# partials at 8-64, wqkv and w_gate_up streamed up to 64 rows): one Ouro loop at the real
# shapes against XLA's at 1 and 64 rows; bursts end to end (warm-up, 0 compilations).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python3 -m loopjax.bench.probes.ops_check --rows 1,64 > /tmp/ops.log 2>&1
echo "ops rc=$?"; grep "rows\|rror" /tmp/ops.log | cut -c1-200
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 90 ouro-1.4b -C 32 32
bc b_ouro128 85 ouro-1.4b -C 128 --max-num-rows 128
cd /tmp && tar czf $OUT/logs.tgz *.log
