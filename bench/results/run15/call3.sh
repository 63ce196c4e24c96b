# Run 15 call 3 (tree: 3d61de0 + call 1's TUNED block sizes): prefill steps of 4 x 512 vs 8 x 512
# tokens, and end to end with prefill steps of up to 8 x 512 tokens (max_prefill_tokens 4096,
# max_prefill_rows 8) against the defaults (2048, 4): Ouro-1.4B burst-32 / burst-128,
# Huginn-0125 burst-8.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
BIG="--max-prefill-tokens 4096 --max-prefill-rows 8 --prefill-token-buckets 16 32 64 128 256 512 1024 2048 4096"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 130 python3 -m loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --shapes 4x512,8x512 --huginn-shapes 4x512,8x512 --backend pallas --startup-backends none --out $OUT/p_sizes.json > /tmp/p_sizes.log 2>&1
echo "== p_sizes rc=$?"; grep "% of peak\|x512" /tmp/p_sizes.log | grep -v "^|" | cut -c1-170 | head -12
bc b_ouro 75 ouro-1.4b -C 32 32
bc b_ouro_big 80 ouro-1.4b -C 32 32 $BIG
bc b_huginn 95 huginn-0125 -C 8 8
bc b_huginn_big 95 huginn-0125 -C 8 8 $BIG
bc b_ouro128 75 ouro-1.4b -C 128 --max-num-rows 128
cd /tmp && tar czf $OUT/logs.tgz *.log
