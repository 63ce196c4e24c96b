# Run 27 call 6 (working tree: 6ffdb27 + a 4-row decode bucket whose attention splits toward
# one program per SM; _base = 6ffdb27): end to end, base tree first then new, Ouro-1.4B:
# (a) 4 long requests (-C 4 4 -P 8192 -O 256, --max-context-len 16384: a wide page table);
# (b) 4 and 32 short ones (-C 4 4 32 32 -P 512 -O 128, --max-context-len 1024), with warm-up.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
K="--kv-memory-bytes 68719476736 --workload burst --no-progress"
LONG="ouro-1.4b -C 4 4 -P 8192 -O 256 --max-context-len 16384 $K --max-seconds 120"
SHORT="ouro-1.4b -C 4 4 32 32 -P 512 -O 128 --max-context-len 1024 $K --max-seconds 120"
bu() { tag=$1; shift
  timeout 130 python3 -m loopjax.cli bench "$@" --out $OUT/$tag.json > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "engine ready|burst on" $OUT/$tag.log | sed -E 's/ \| prefix cache off//; s/ \| warm-up.*//' | cut -c1-200; }
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && bu long_base $LONG && bu short_base $SHORT)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
bu long_new $LONG
bu short_new $SHORT
