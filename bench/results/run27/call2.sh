# Run 27 call 2 (tree c65e074 + the probes): (a) the swapped partials of wo and w_down with
# other K splits / K tiles, in the Ouro-1.4B decode step at 8 and 32 rows (split_probe.py);
# (b) burst-128 in-process (call 1's in-process arm spent its --max-seconds on warm-up).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 330 python3 bench/results/run27/split_probe.py base 2048:8 2048:2 5632:8 5632:2 2048:4:128 base -- \
  --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --context 512 --rows 8,32 --iters 20 \
  > $OUT/split.log 2>&1
echo "split rc=$?"; grep -E "^== arm| rows |rror" $OUT/split.log | sed -E 's/ +/ /g' | cut -c1-200
ENG="--max-context-len 1024 --kv-memory-bytes 68719476736 --max-num-rows 128"
timeout 200 python3 -m loopjax.cli bench ouro-1.4b -C 128 128 128 --workload burst -P 512 -O 128 --no-progress --max-seconds 180 $ENG --out $OUT/inproc128.json > $OUT/inproc128.log 2>&1
echo "== inproc128 rc=$?"; grep -E "engine ready|burst on" $OUT/inproc128.log | cut -c1-250
