# Run 23 call 2: end to end with penalties. Burst-32 (P=512, O=128) with every request greedy
# (the bench's default), drawing (temperature 0.8, top-p 0.9, seeded), or drawing with penalties
# (repetition 1.1, presence 0.5, frequency 0.3: every request processes logits), on this tree,
# and drawing on the base tree (_base/, d2a8539). The bench's SamplingParams is replaced per arm
# (a subclass adding the arm's settings) after every module is imported.
set -u
# Each arm installs its tree (pip -e) first: loopjax.bench maps to bench/ through pyproject.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
B="--workload burst -P 512 -O 128 --max-context-len 1024 --kv-memory-bytes 68719476736 --no-progress --max-seconds 60"
run() { tag=$1 arm=$2 dir=$3; shift 3
  (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && timeout 150 python3 -c "
import sys
from loopjax.bench import cli
import loopjax.sampling_params as sp
extra = {'greedy': {}, 'drawn': dict(temperature=0.8, top_p=0.9, seed=1),
         'penalized': dict(temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.1,
                           presence_penalty=0.5, frequency_penalty=0.3)}['$arm']
class Params(sp.SamplingParams):  # the bench's requests (bench/workloads.py) with the arm's settings
    def __init__(self, **kw):
        super().__init__(**{**kw, **extra})
sp.SamplingParams = Params
sys.argv = ['loopjax.bench.cli'] + sys.argv[1:]
cli.main()" "$@" $B --out /tmp/$tag.json > /tmp/$tag.log 2>&1)
  echo "== $tag rc=$?"; grep -E "engine ready|burst on|compil" /tmp/$tag.log | cut -c1-150; }
run penalized1 penalized . ouro-1.4b -C 32 32
run drawn1 drawn . ouro-1.4b -C 32 32
run drawn_base1 drawn _base ouro-1.4b -C 32 32
run greedy1 greedy . ouro-1.4b -C 32 32
cd /tmp && tar czf $OUT/call2.tgz penalized* drawn* greedy*
