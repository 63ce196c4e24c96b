export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; git rev-parse --short HEAD; date -u
R=/tmp/r3; mkdir -p $R
go() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout --signal=INT --kill-after=10 $lim "$@" > $R/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -v "cuda_timer\|^W1129\|^I1129\|^wrote" $R/$name.log | tail -n ${TAILN:-3}; }
TAILN=20 go probe_rms 60 python3 probe_rms.py
B="python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --decode-row-buckets 8 16 32 --prefill-token-buckets 256 512"
go b32_async 70 $B --out $R/b32_async.json
go b32_sync 70 $B --no-async-scheduling --out $R/b32_sync.json
go b32_async_pallas 70 $B --attention-backend pallas --out $R/b32_async_pallas.json
TAILN=70 go profile_ouro 110 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 64 -C 32 --max-context-len 1024 --kv-memory-bytes 68719476736 --decode-row-buckets 8 16 32 --prefill-token-buckets 256 512 --trace-steps 8 --no-split-wait --out $R/profile_ouro
go b32_4096_xla 70 python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --kv-memory-bytes 68719476736 --no-progress --decode-row-buckets 8 16 32 --prefill-token-buckets 256 512 --out $R/b32_4096_xla.json
go b32_4096_pallas 70 python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 32 --kv-memory-bytes 68719476736 --no-progress --decode-row-buckets 8 16 32 --prefill-token-buckets 256 512 --attention-backend pallas --out $R/b32_4096_pallas.json
go b128_async 100 python3 -m loopjax.bench.cli ouro-1.4b --workload burst -P 512 -O 128 -C 128 --max-num-rows 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --out $R/b128_async.json
tar czf $OUT/call3.tgz -C $R . && ls -la $OUT
