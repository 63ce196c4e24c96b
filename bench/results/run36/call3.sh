#!/bin/bash
# Run 36 call 3 (session 29): the burst's first step after this session's host changes. Run 31
# call 1 measured 7.37 ms of idle device in burst-32's first step (its inputs reach an idle
# device). The burst's first 12 engine steps traced for the session's tree and its start
# (_base/, 248c5f6), each read by bench/probes/gap_census.py (per-step idle).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
inst() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
E="--max-context-len 1024 --kv-memory-bytes 68719476736"
for arm in new base; do
  dir=.; [ $arm = base ] && dir=_base
  inst $dir
  (cd $dir && timeout 200 python3 -m loopjax.bench.profile ouro-1.4b -P 512 -O 128 -C 32 $E --trace-from start \
    --trace-steps 12 --keep-trace --out /tmp/prof_$arm > /tmp/prof_$arm.log 2>&1)
  echo "== profile $arm rc=$?"; grep -v "^W1\|cuda_timer" /tmp/prof_$arm.log | grep -iE "burst|first|step" | cut -c1-170 | head -12
  (cd $dir && python3 -m loopjax.bench.probes.gap_census /tmp/prof_$arm/trace --top 10 2>&1) > $OUT/census_$arm.txt
  grep -iE "step|span|busy|idle" $OUT/census_$arm.txt | cut -c1-170 | head -24
done
