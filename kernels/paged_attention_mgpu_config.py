"""The Mosaic GPU paged decode attention's configuration (kernels/paged_attention_mgpu.py):
which shapes it takes, its block, pipeline-stage and context-split defaults (measured on the
H200), and the check that settles a call's static configuration before the kernel is traced.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from loopjax.step_plan import LONG_CONTEXT_KEYS

from ._common import NUM_SMS, SMEM_BUDGET, resolve_interpret
from .paged_attention import check_paged_inputs, default_num_splits

ROWS = 64  # rows of a WGMMA register layout: keys are processed in tiles of 64


def shape_problem(group_size: int, page_size: int, head_dim: int, dtype) -> str | None:
    """Why the kernel cannot take these shapes (a one-line error), or None when it can."""
    if group_size > 8:
        return f"the Mosaic GPU kernel takes at most 8 q heads per kv head, got {group_size}"
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    if page_size % 8 or row_bytes % 32:
        return (f"the Mosaic GPU kernel needs page_size a multiple of 8 (got {page_size}) and "
                f"head_dim rows of 32-byte multiples (got {head_dim} x {row_bytes // head_dim} bytes)")
    slot_bytes = 2 * default_pages_per_block(page_size) * page_size * row_bytes  # K and V
    if slot_bytes > SMEM_BUDGET:
        return (f"the Mosaic GPU kernel's smallest block of pages at page_size {page_size} "
                f"(K and V: {slot_bytes} bytes) exceeds its {SMEM_BUDGET} bytes of shared memory")
    return None


def default_pages_per_block(page_size: int) -> int:
    """The fewest pages whose keys fill whole tiles of ROWS (block_k = lcm(page_size, ROWS))."""
    return ROWS // math.gcd(page_size, ROWS)


def default_num_stages(slot_bytes: int) -> int:
    """Slots in flight by default: up to 3 in half the shared memory (two programs per SM)."""
    return max(1, min(3, SMEM_BUDGET // (2 * slot_bytes)))


ONE_SPLIT_PROGRAMS = 128  # (token, kv head) programs from which one context split is fastest
FEW_PROGRAMS_TARGET = 64  # below that: split the context until about this many programs run
# Page tables wider than this many blocks (64-key blocks by default: 4,096 keys, where the
# engine adds its 4-row decode bucket) split toward one program per SM.
LONG_CONTEXT_BLOCKS = LONG_CONTEXT_KEYS // ROWS
LONG_CONTEXT_MIN_BLOCKS = 2  # splits toward one program per SM take at least this many blocks


def mosaic_num_splits(n: int, hkv: int, max_blocks: int) -> int:
    """Context splits by default: one from ONE_SPLIT_PROGRAMS (token, kv head) programs, about
    one per SM of the H200's 132 (run 12, in the decode step: Ouro-1.4B 8 rows x 16 heads,
    6.10 vs 6.64 ms per step with the shared heuristic's 3 splits at context 512, 8.31 vs
    8.88 ms at 2048; one split also needs no combine kernel). Below FEW_PROGRAMS_TARGET
    programs the context is split until ~FEW_PROGRAMS_TARGET run (run 13, Ouro-1.4B 1 row x 16
    heads: 4 splits 4.87 / 5.24 ms per step at context 512 / 2048, against 4.94 / 5.56 with
    the shared heuristic's 8 / 17 splits, 5.05 / 6.43 with one, 4.96 / 5.63 with two). From
    FEW_PROGRAMS_TARGET programs, or where the page table is wider than LONG_CONTEXT_BLOCKS,
    it is split until up to ONE_SPLIT_PROGRAMS run, in runs of at least LONG_CONTEXT_MIN_BLOCKS
    blocks (`default_min_blocks_per_split`). Run 27, Ouro-1.4B, pipelined steps at context 512
    / 2,048 / 8,192 / 32,768: 1 row with a 32,768-key table, 8 such splits 4,918 / 5,200 /
    6,322 / 10,645 us against 4 splits' 4,816 / 5,197 / 6,699 / 12,696; 4 rows (64 programs),
    2 splits 5,272 / 6,455 / 10,924 / 28,706 against one's 5,350 / 6,822 / 12,872 / 37,538."""
    programs = n * hkv
    if programs >= ONE_SPLIT_PROGRAMS:
        return 1
    if _splits_to_one_per_sm(programs, max_blocks):  # NOTE: at most ONE_SPLIT_PROGRAMS programs
        return max(1, min(max_blocks, ONE_SPLIT_PROGRAMS // programs))
    return default_num_splits(n, hkv, max_blocks, target_programs=FEW_PROGRAMS_TARGET)


def default_min_blocks_per_split(n: int, hkv: int, max_blocks: int) -> int:
    """The fewest blocks a context split takes by default (the kernel divides each row's own
    context among its splits, so a short context leaves the last splits empty rather than
    spreading thin): LONG_CONTEXT_MIN_BLOCKS where `mosaic_num_splits` splits toward one
    program per SM, else 1."""
    return LONG_CONTEXT_MIN_BLOCKS if _splits_to_one_per_sm(n * hkv, max_blocks) else 1


def _splits_to_one_per_sm(programs: int, max_blocks: int) -> bool:
    """Whether `programs` (token, kv head) programs split toward one per SM (see above)."""
    return programs < ONE_SPLIT_PROGRAMS and (programs >= FEW_PROGRAMS_TARGET
                                              or max_blocks > LONG_CONTEXT_BLOCKS)


PROGRAMS_PER_SM = 2  # default_num_stages' slots take half an SM's shared memory each


def default_heads_per_program(n: int, hkv: int, num_splits: int) -> int:
    """kv heads one program attends in turn, by default: 1 while the (token, kv head, split)
    programs fit one wave of PROGRAMS_PER_SM per SM; above, the fewest (a divisor of hkv) that
    fit one wave without loading the busiest SM with more heads than one head per program
    does (else 1). One wave pays the pipeline's ramp and the programs' ends once instead of
    once per wave. Run 19 (H200, in the decode step, context 512): Ouro-1.4B at 32 rows 2 heads
    per program, 7.98 vs 8.15 ms; Huginn-0125 at 32 rows with 11 (160 programs: 28 SMs run two,
    22 heads against 14) 43.9 vs 41.9 ms, which the load condition now rules out."""
    items = n * hkv * num_splits
    if items <= NUM_SMS * PROGRAMS_PER_SM:
        return 1
    busiest = -(-items // NUM_SMS)  # heads on the busiest SM, one head per program
    for heads in range(2, hkv + 1):
        programs = items // heads
        if hkv % heads == 0 and programs <= NUM_SMS * PROGRAMS_PER_SM:
            return heads if heads * -(-programs // NUM_SMS) <= busiest else 1
    return 1


def settle_config(q, k_cache, v_cache, plane, page_table, row_of_token, positions, *,
            pages_per_block, num_splits, num_stages, interpret, heads_per_program=None,
            min_blocks_per_split=None) -> dict:
    """Checks the attention inputs and fills in the configuration -> the static keyword
    arguments of paged_attention_mgpu's `_decode_call` / `_write_call`."""
    n, hq, d, _, hkv, _, s, _, m = check_paged_inputs(
        q, k_cache, v_cache, plane, page_table, row_of_token, positions
    )
    problem = shape_problem(hq // hkv, s, d, q.dtype)
    if problem:
        raise ValueError(problem)
    itemsize = jnp.dtype(q.dtype).itemsize
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(s)
    block_k = pages_per_block * s
    if pages_per_block < 1 or block_k % ROWS:
        raise ValueError(f"pages_per_block x page_size must be a multiple of {ROWS}, got "
                         f"{pages_per_block} x {s}")
    slot_bytes = 2 * block_k * d * itemsize  # K and V of one block
    if num_stages is None:
        num_stages = default_num_stages(slot_bytes)
    if num_stages < 1 or num_stages * slot_bytes > SMEM_BUDGET:
        raise ValueError(f"num_stages={num_stages} slots of {slot_bytes} bytes do not fit the "
                         f"{SMEM_BUDGET} bytes of shared memory (at least 1 slot)")
    max_blocks = -(-m // pages_per_block)
    if num_splits is None:
        num_splits = mosaic_num_splits(n, hkv, max_blocks)
    if min_blocks_per_split is None:
        min_blocks_per_split = default_min_blocks_per_split(n, hkv, max_blocks)
    if min_blocks_per_split < 1:
        raise ValueError(f"min_blocks_per_split must be >= 1, got {min_blocks_per_split}")
    if heads_per_program is None:
        heads_per_program = default_heads_per_program(n, hkv, num_splits)
    if heads_per_program < 1 or hkv % heads_per_program:
        raise ValueError(f"heads_per_program must divide the {hkv} kv heads, got {heads_per_program}")
    return dict(pages_per_block=pages_per_block, num_splits=num_splits,
                min_blocks_per_split=min_blocks_per_split, num_stages=num_stages,
                heads_per_program=heads_per_program, normalize=num_splits == 1,
                interpret=resolve_interpret(interpret))
