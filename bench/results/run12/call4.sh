# Run 12 call 4: the Mosaic decode kernel that writes the step's K/V (correctness on the GPU,
# then in the step against XLA's scatters; context splits at 8 rows), then the engine bursts
# with everything merged (1-row bucket, int-key sort, in-kernel KV write).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m loopjax.bench.probes.attn_write_check > /tmp/attn_write_check.log 2>&1; echo "check rc=$?"; cat /tmp/attn_write_check.log | grep -v "^W\|^I0"
ds() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.decode_step --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 "$@" --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep " rows " /tmp/$tag.log | cut -c1-200; }
ds o_write 150 --preset ouro-1.4b --rows 1,8,32 --iters 20 --attn-write kernel,xla
ds o_splits 70 --preset ouro-1.4b --rows 8 --iters 20 --attn-splits 1,2
ds h_write 110 --preset huginn-0125 --rows 1,8 --attn-write kernel,xla
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready\|compil" /tmp/$tag.log | cut -c1-250; }
bc b_ouro 130 ouro-1.4b -C 32 128 --max-num-rows 128
bc b_ouro1 60 ouro-1.4b -C 1
bc b_huginn 110 huginn-0125 -C 8 32
cd /tmp && tar czf $OUT/logs.tgz *.log
