export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; git rev-parse --short HEAD; date -u
B="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --decode-row-buckets 8 16 32 --prefill-token-buckets 256 512"
go() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout --signal=INT --kill-after=10 $lim "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -v "cuda_timer\|^W1129\|^I1129" $OUT/$name.log | tail -n ${TAILN:-6}; }
go b32_xla 80 $B --attention-backend auto --out $OUT/b32_xla.json
go b32_pallas 80 $B --attention-backend pallas --out $OUT/b32_pallas.json
go b32_ctxb 95 $B --attention-backend auto --decode-context-buckets 576 640 768 --out $OUT/b32_ctxb.json
TAILN=12 go sessions_huginn 215 python3 -m loopjax.bench.cli huginn-0125 --workload sessions -N 64 -T 6 -P 256 -O 32 -U 32 --compare-prefix-cache --max-context-len 1024 --kv-memory-bytes 123480309760 --max-seconds 200 --no-progress --out $OUT/sessions_huginn.json
TAILN=60 go ksweep 105 python3 -m loopjax.bench.kernels --only sweep --out $OUT/ksweep.json
