# Run 27 call 5 (working tree: c65e074 + min_blocks_per_split and the wide-table split rule;
# _base = c65e074): (a) the Ouro-1.4B decode step at 1 row in an executable whose page table
# holds 32,768 keys (as `--max-context-len 32768` compiles), contexts 512 to 32,768: the new
# default (8 splits of >= 2 blocks) against the old rule (4 splits); (b) one long request end
# to end (`loopjax bench -C 1 -P 16384 -O 256 --max-context-len 32768`), base tree first.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
B="ouro-1.4b -C 1 1 --workload burst -P 16384 -O 256 --max-context-len 32768 --kv-memory-bytes 68719476736 --no-progress --max-seconds 140"
(cd _base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -m loopjax.cli bench $B --out $OUT/long_base.json > $OUT/long_base.log 2>&1; echo "== base rc=$?")
grep -E "engine ready|burst on" $OUT/long_base.log | cut -c1-220
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python3 -m loopjax.bench.decode_step --preset ouro-1.4b --backend pallas_mgpu --matmul auto --per-loop-rows 0 --iters 10 --kv-gb 60 --rows 1 --context 512,2048,8192,32768 --page-width 32768 --attn-splits auto,4:1 --out $OUT/wide.json > $OUT/wide.log 2>&1
echo "== wide rc=$?"; grep -E " rows |rror" $OUT/wide.log | sed -E 's/ +/ /g; s/ouro-1.4b pallas_mgpu auto xla fused //' | cut -c1-150
timeout 150 python3 -m loopjax.cli bench $B --out $OUT/long_new.json > $OUT/long_new.log 2>&1; echo "== new rc=$?"
grep -E "engine ready|burst on" $OUT/long_new.log | cut -c1-220
