set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
common="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --compilation-cache-dir /tmp/jaxcc --max-seconds 60"
run() { tag=$1; shift; timeout 100 python3 -m loopjax.bench.cli "$@" $common --out $OUT/$tag.json > /tmp/$tag.log 2>&1; echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-230; }
run o_default ouro-1.4b -C 32
run o_share_off ouro-1.4b -C 32 --no-prefill-share-per-loop
run o_xla_attn ouro-1.4b -C 32 --attention-backend xla
run o_per_loop ouro-1.4b -C 32 --no-fused-decode
run h_share_off huginn-0125 -C 8 --no-prefill-share-per-loop
run h_per_loop huginn-0125 -C 8 --no-fused-decode
cd /tmp && tar czf $OUT/logs.tgz *.log
