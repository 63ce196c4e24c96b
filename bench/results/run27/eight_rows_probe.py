"""Run 27 probe: the 8-row decode bucket at a wide page table with 5-7 long rows, as the engine
runs it (`loopjax bench`), with the attention's rule as it is (one split from 128 programs) or
patched to 2 splits of at least 8 blocks there ('split8'). Usage: python eight_rows_probe.py
ARM BENCH_ARGS..."""
import sys

from loopjax.bench import cli
from loopjax.kernels import paged_attention_mgpu_config as mgpu

arm, argv = sys.argv[1], sys.argv[2:]
if arm == "split8":
    base_splits, base_min = mgpu.mosaic_num_splits, mgpu.default_min_blocks_per_split

    def wide_eight(n, hkv, max_blocks):
        return n * hkv == 128 and max_blocks > mgpu.LONG_CONTEXT_BLOCKS

    mgpu.mosaic_num_splits = lambda n, hkv, mb: 2 if wide_eight(n, hkv, mb) else base_splits(n, hkv, mb)
    mgpu.default_min_blocks_per_split = lambda n, hkv, mb: (8 if wide_eight(n, hkv, mb)
                                                            else base_min(n, hkv, mb))
print(f"== arm {arm}", flush=True)
sys.exit(cli.main(argv))
