# Run 14 call 10 (tree 156f696 + layers.linear_in_dtype in 'auto''s XLA products on the GPU):
# prefill steps (converts gone?), Huginn-0125 burst-8 and Ouro-1.4B burst-32.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --shapes 4x512 --huginn-shapes 4x512 --backend pallas --startup-backends none --trace /tmp/ptrace --out $OUT/p_dtype.json > /tmp/p_dtype.log 2>&1
echo "== p_dtype rc=$?"; grep "wrapped_convert\|write_kv\|% of peak" /tmp/p_dtype.log | grep -v "^|" | cut -c1-160 | head -12
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_huginn 110 huginn-0125 -C 8 8
bc b_ouro 80 ouro-1.4b -C 32 32
cd /tmp && tar czf $OUT/logs.tgz *.log
