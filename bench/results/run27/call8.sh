# Run 27 call 8 (tree 8d6337c): 6 requests of 8,192-token prompts with max_context_len 16,384:
# their decode runs in the 8-row bucket (one attention split, 96 of 128 programs real), as it
# is and with 2 splits of at least 8 blocks there (eight_rows_probe.py; not a default).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
B="ouro-1.4b -C 6 6 -P 8192 -O 128 --max-context-len 16384 --kv-memory-bytes 68719476736 --workload burst --no-progress --max-seconds 110"
for arm in base split8; do
  timeout 120 python3 bench/results/run27/eight_rows_probe.py $arm $B --out $OUT/$arm.json > $OUT/$arm.log 2>&1
  echo "== $arm rc=$?"; grep -E "engine ready|burst on" $OUT/$arm.log | sed -E 's/ \| prefix cache off//; s/ \| warm-up.*//' | cut -c1-200
done
