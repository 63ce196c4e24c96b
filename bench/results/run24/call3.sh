# Run 24 call 3: loopjax.score (the echo path of `loopjax serve`) on the GPU at the real shapes.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 500 python3 bench/results/run24/score_gpu.py 2>&1 | tee /tmp/score_gpu.log | grep -v Warning | tail -8
cp /tmp/score_gpu.log $OUT/
