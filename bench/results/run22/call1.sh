# Run 22 call 1 (tree 5e79d7f, session 14's last commit): the first GPU run of the final routing
# (3fd867b, PagedAttention.attend_projected). The rotating K/V write bitwise on the GPU, the
# prefill steps traced (the write kernel must be in them), the decode steps, then end to end.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
r() { tag=$1 limit=$2; shift 2
  timeout $limit python3 -m "$@" > /tmp/$tag.log 2>&1; echo "== $tag rc=$?"; }
r kernels 120 loopjax.bench.kernels --only kv_write
grep -iE "kv_write|rope_write|bitwise|max" /tmp/kernels.log | cut -c1-140 | head -20
r prefill 200 loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --shapes 4x512,1x2048 \
  --huginn-shapes 4x512 --backend pallas --startup-backends none --iters 10 --trace /tmp/tr_prefill --out /tmp/prefill.json
grep -iE " ms|rope_write|write|attention" /tmp/prefill.log | head -40 | cut -c1-160
r steps 150 loopjax.bench.decode_step --preset ouro-1.4b --rows 1,32 --context 512 --backend pallas_mgpu \
  --matmul auto --per-loop-rows 0 --iters 20 --out /tmp/steps.json
grep -E "rows|us|µs" /tmp/steps.log | tail -8 | cut -c1-160
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 90"
b() { tag=$1; shift
  timeout 120 python3 -m loopjax.bench.cli "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "burst on|warm-up|compil" /tmp/$tag.log | cut -c1-170 | head -6; }
b b32_1 ouro-1.4b -C 32 32 32
cd /tmp && tar czf $OUT/call1.tgz *.log *.json
