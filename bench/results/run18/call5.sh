# Run 18 call 5 (defaults now: qkv + RoPE on Mosaic at 8-64 rows, SiLU*up and the norms'
# partials on Mosaic at 8-32): the qkv + RoPE kernel at 1 row (x padded to 8 rows, cos, sin and
# the outputs through shared memory by TMA) per kernel and in the step; the defaults against
# all-Triton ('none') alternating; bursts end to end (warm-up, 0 compilations).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 60 python3 -m loopjax.bench.probes.rope_qkv_chain --rows 1 --arms triton,mgpu --trace /tmp/tr --out $OUT/chain.json > /tmp/chain.log 2>&1
echo "chain rc=$?"; grep "^rows\|rror\|loopjax_streaming_matmul_rope" /tmp/chain.log | cut -c1-160
Q1="qkv=1,8,16,32,64+silu=8,16,32+norms=8,16,32"
timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rows "base;$Q1;base;$Q1" --per-loop-rows 0 --context 512 --rows 1 --iters 30 --out $OUT/steps1.json > /tmp/steps1.log 2>&1
echo "steps1 rc=$?"; grep " rows \|rror" /tmp/steps1.log | cut -c1-250
timeout 200 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --mosaic-rows "none;base;none;base" --per-loop-rows 0 --context 512 --rows 8,32 --iters 20 --out $OUT/steps.json > /tmp/steps.log 2>&1
echo "steps rc=$?"; grep " rows \|rror" /tmp/steps.log | cut -c1-250
bc() { tag=$1; lim=$2; shift 2
  timeout $lim python3 -m loopjax.bench.cli "$@" --workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds $((lim - 20)) --out $OUT/$tag.json > /tmp/$tag.log 2>&1
  echo "== $tag rc=$? $*"; grep "burst on\|engine ready" /tmp/$tag.log | cut -c1-260; }
bc b_ouro 90 ouro-1.4b -C 32 32
bc b_ouro128 80 ouro-1.4b -C 128 --max-num-rows 128
cd /tmp && tar czf $OUT/logs.tgz *.log
