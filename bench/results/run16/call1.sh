# Run 16 call 1 (tree 4bbfb2d): where the small kernels of a step come from. Optimized HLO
# (XLA_FLAGS dump) beside kernel traces: Huginn-0125 8-row step, Ouro-1.4B 32-row step,
# Ouro-1.4B 4 x 512 prefill step.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
run() { tag=$1; lim=$2; shift 2
  XLA_FLAGS="--xla_dump_to=/tmp/dump_$tag --xla_dump_hlo_as_text" timeout $lim python3 -m loopjax.bench.$@ > /tmp/$tag.log 2>&1
  echo "== $tag rc=$?"; grep " rows \|rror\|of peak" /tmp/$tag.log | cut -c1-220 | head -8
  mkdir -p /tmp/hlo/$tag; find /tmp/dump_$tag -name "*after_optimizations.txt" -size +200k -exec cp {} /tmp/hlo/$tag/ \; ; ls -la /tmp/hlo/$tag | head; }
run h8 150 decode_step --preset huginn-0125 --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 8 --iters 10 --trace /tmp/htrace
run o32 120 decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 32 --iters 10 --trace /tmp/otrace
run p4 150 prefill --preset ouro-1.4b --shapes 4x512 --huginn-shapes 4x512 --backend pallas --startup-backends none --trace /tmp/ptrace
cd /tmp && tar czf $OUT/logs.tgz *.log && tar czf $OUT/hlo.tgz hlo
