"""Run 27 probe: the swapped-operand partials of Ouro-1.4B's wo [2048, 2048] and w_down
[5632, 2048] (kernels/streaming_matmul_pdl.py, 8-64 rows) with other K splits / K tiles, timed
in the decode step (`loopjax.bench.decode_step`), one arm after another in one process
(jax.clear_caches() between arms, so each arm lowers its own kernels).
Arms: 'base' or 'K:split[:block_k]' items joined by '+', e.g. '2048:8+5632:2'.
Usage: python split_probe.py ARM [ARM ...] -- DECODE_STEP_ARGS"""
import sys

import jax

from loopjax.bench import decode_step
from loopjax.kernels import streaming_matmul_pdl as smp

BASE = smp.pdl_config


def patched(arm: str):
    table = {}
    for item in filter(None, arm.removeprefix("base").split("+")):
        k, split, *bk = map(int, item.split(":"))
        table[k] = (split, bk[0] if bk else None)

    def config(m, k, n):
        cfg = BASE(m, k, n)
        if k in table:
            split, bk = table[k]
            bk = bk or cfg.block_k
            steps = k // (bk * split)
            stage_bytes = 2 * (bk * cfg.block_n + smp.ROWS * bk)
            stages = max(2, min(steps, 200 * 1024 // 2 // stage_bytes))
            cfg = cfg._replace(split_k=split, block_k=bk, num_stages=stages)
        return cfg
    return config


sep = sys.argv.index("--")
for arm in sys.argv[1:sep]:
    smp.pdl_config = patched(arm)
    jax.clear_caches()
    print(f"== arm {arm}: wo {smp.pdl_config(32, 2048, 2048)}, w_down {smp.pdl_config(32, 5632, 2048)}",
          flush=True)
    decode_step.main(sys.argv[sep + 1:])
