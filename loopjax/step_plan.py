"""The scheduler's vocabulary (pure Python, no JAX): `SchedulerConfig` (the budgets and buckets
every plan obeys), `PrefillShare` (the prefill steps allowed between decodes), `StepPlan` (one
step, as the runner receives it) and `StepOutput` (what the runner hands back).
`loopjax.scheduler` re-exports StepKind and those but PrefillShare.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from loopjax.request import Request, RequestPhase
from loopjax.wording import counted, pool_size


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def _bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def _capped(buckets: tuple[int, ...], limit: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in buckets if b < limit} | {limit}))


# Decode row buckets (each capped by max_num_rows). 2-7 rows run padded to 8, which is not slower
# on the H200 at short contexts (run 1: weights-only step 4.90 ms at 8 rows vs 8.57 ms at 1 row
# with XLA products; the Pallas decode kernels stop at each row's length, so a padding token
# reads a single block; run 27: 4 short requests 745-747 tok/s padded to 8 against 723-724 in
# a 4-row bucket). Each bucket dropped is an executable less at start-up (run 10: the 1-, 2-
# and 4-row ones were the slowest). One row keeps its own bucket, where `matmul='auto'` streams
# every product: the device step is 11% shorter than padded to 8 rows for Ouro-1.4B (run 12,
# context 512, steps back to back as the engine runs them: 6.0 vs 6.8 ms) and 9% for
# Huginn-0125 (30.2 vs 33.0 ms).
DECODE_ROW_BUCKETS = (1, 8, 16, 32, 64, 128)
# Where a request may grow past LONG_CONTEXT_KEYS, 2-4 rows get a bucket of their own: the decode
# attention then splits their contexts toward one program per SM, which a padded 8-row step
# (one split: 64 of its 128 programs real at 4 rows) does not (kernels/paged_attention_mgpu_
# config.py; its wide page tables start at the same 4,096 keys). Run 27, Ouro-1.4B, 4 requests
# of 8,192-token prompts, max_context_len 16,384: 268-271 tok/s (TPOT p50 12.2-12.4 ms) against
# 217-235 (14.5-15.9 ms) padded to 8.
LONG_CONTEXT_KEYS = 4096
LONG_CONTEXT_DECODE_ROW_BUCKETS = (1, 4, 8, 16, 32, 64, 128)


def default_decode_row_buckets(max_context_len: int) -> tuple[int, ...]:
    """The decode row buckets an engine compiles unless configured (before max_num_rows caps them)."""
    return LONG_CONTEXT_DECODE_ROW_BUCKETS if max_context_len > LONG_CONTEXT_KEYS else DECODE_ROW_BUCKETS


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16                   # tokens per KV page
    num_pages: int = 1024                 # pages in the pool
    max_num_rows: int = 64                # admitted requests at once = rows of a decode step
    decode_row_buckets: tuple[int, ...] = DECODE_ROW_BUCKETS  # capped by max_num_rows
    max_prefill_tokens: int = 2048        # real tokens per prefill step (chunked above it)
    prefill_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # capped likewise
    max_prefill_rows: int = 8             # requests packed into one prefill step
    max_context_len: int = 4096           # prompt + generated tokens of one request
    max_prefill_batches_before_decode: int = 1  # prefill steps per decode step (x loops, see below)
    prefill_share_per_loop: bool = True   # a decode step of L loops allows L x the prefill steps
    num_loops: int = 4                    # default depth of a request's tokens (the model's)
    max_loops: int | None = None          # largest depth a request may ask for; None = num_loops
    fused_decode: bool = True             # fixed-depth rows run all loops in one submission
    enable_prefix_caching: bool = False   # share full KV pages of common prefixes (prefix_cache.py)
    decode_page_planes: int = 0           # Ouro 'shared' KV: decode pages per page (block_manager.py)

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_num_rows", "max_prefill_tokens",
                     "max_prefill_rows", "max_context_len", "max_prefill_batches_before_decode",
                     "num_loops"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_loops is not None and self.max_loops < self.num_loops:
            raise ValueError(f"SchedulerConfig.max_loops ({self.max_loops}) < num_loops ({self.num_loops})")
        for name in ("decode_row_buckets", "prefill_token_buckets"):
            buckets = getattr(self, name)
            if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"SchedulerConfig.{name} must be positive integers, got {buckets!r}")

    @property
    def loop_cap(self) -> int:
        return self.num_loops if self.max_loops is None else self.max_loops

    @cached_property  # NOTE: cached (here and below): every plan picks a bucket
    def row_buckets(self) -> tuple[int, ...]:
        """Decode row counts that are compiled; the last is max_num_rows."""
        return _capped(self.decode_row_buckets, self.max_num_rows)

    @cached_property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        return _capped(self.decode_row_buckets, self.max_prefill_rows)

    @cached_property
    def token_buckets(self) -> tuple[int, ...]:
        """Packed prefill token counts that are compiled; the last is max_prefill_tokens."""
        return _capped(self.prefill_token_buckets, self.max_prefill_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @cached_property
    def max_seq_len(self) -> int:
        """Tokens one request may reach: the context limit, or the whole pool if smaller."""
        return min(self.max_context_len, self.capacity_tokens)

    @property
    def max_pages_per_request(self) -> int:
        """Page-table width: pages of the longest sequence."""
        return -(-self.max_seq_len // self.page_size)

    def row_bucket(self, num_rows: int) -> int:
        return _bucket(self.row_buckets, num_rows, "decode rows")

    def prefill_row_bucket(self, num_rows: int) -> int:
        return _bucket(self.prefill_row_buckets, num_rows, "prefill rows")

    def token_bucket(self, num_tokens: int) -> int:
        return _bucket(self.token_buckets, num_tokens, "prefill tokens")

    def check_request(self, request) -> None:
        """A one-line ValueError for a request that can never run under this config; sets
        the request's default loop count."""
        rid = request.request_id
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        if n + 1 > self.max_context_len:
            raise ValueError(f"request {rid!r}: prompt of {counted(n, 'token')} leaves no room to generate "
                             f"within max_context_len={self.max_context_len}")
        if n + 1 > self.capacity_tokens:
            raise ValueError(f"request {rid!r}: prompt of {counted(n, 'token')} does not fit the KV pool "
                             f"({pool_size(self.num_pages, self.page_size)})")
        if request.max_loops is None:
            request.max_loops = self.num_loops
        if not 1 <= request.max_loops <= self.loop_cap:
            raise ValueError(f"request {rid!r}: loops must be in [1, {self.loop_cap}], "
                             f"got {request.max_loops}")
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")

    def prefill_share(self, num_loops: int) -> int:
        """Prefill steps allowed after a decode submission of num_loops loops."""
        per_loop = num_loops if self.prefill_share_per_loop else 1
        return per_loop * self.max_prefill_batches_before_decode


class PrefillShare:
    """The prefill steps allowed before the next decode (scheduler.py's module note). A decode
    submission grants `SchedulerConfig.prefill_share` of the loops it runs: a fused one its
    compiled loop count (`loop_count(n)`: the runner's smallest compiled count >= its rows'
    deepest n, through which every row runs or idles; an exit on the device may end it
    sooner), a per-loop one 1. While no row waits to decode, the share starts over: that of a
    decode at the configured depth."""

    def __init__(self, config: SchedulerConfig, loop_count: Callable[[int], int] | None = None):
        self.loop_count = loop_count or (lambda n: n)
        self.restart(config)

    @property
    def used_up(self) -> bool:
        return self.num_prefills >= self.allowance

    def restart(self, config: SchedulerConfig) -> None:
        self.grant(config, config.num_loops if config.fused_decode else 1, fused=config.fused_decode)

    def grant(self, config: SchedulerConfig, num_loops: int, *, fused: bool) -> None:
        """A decode submission of num_loops loops was planned (fused: all its rows' loops)."""
        self.num_prefills = 0
        self.allowance = config.prefill_share(self.loop_count(num_loops) if fused else num_loops)


@dataclass(frozen=True)
class StepPlan:
    step_id: int                    # 0, 1, 2...: planned steps so far
    kind: StepKind                  # PREFILL: packed prompt chunks; DECODE: one input token per row
    requests: tuple[Request, ...]   # real rows in row order (live objects: read them before update)
    token_ranges: tuple[tuple[int, int], ...]  # per row: [start, end) of all_token_ids fed now, at
    #                                 positions start..end-1 (decode: end = start + 1)
    emits: tuple[bool, ...]         # per row: a token is sampled (prefill: the chunk completes the
    #                                 prompt; decode: the row reaches its last loop; an adaptive
    #                                 row may emit earlier, on its exit)
    row_loops: tuple[int, ...]      # per row: loops of its token in all (request.max_loops)
    loop_begin: int                 # first loop run now: 0 except later per-loop decode submissions
    num_loops: int                  # loops run now, >= 1: loop_begin .. loop_begin + num_loops - 1;
    #                                 a row idles in loops >= its row_loops
    num_real_rows: int              # len(requests)
    row_bucket: int                 # compiled rows (>= num_real_rows); the rest are padding rows
    num_real_tokens: int            # tokens fed (decode: num_real_rows)
    token_bucket: int               # compiled tokens (prefill: a token bucket; decode: row_bucket)
    preempted: tuple[Request, ...]  # preempted while planning this step: pages freed; the
    #                                 runner drops any device state it keeps for them
    input_on_device: tuple[bool, ...]  # per row: its (last) input token was sampled by a step
    #                                 still in flight: the host does not know it, the device
    #                                 reads it from the row's last-token slot (decode only)

    def __post_init__(self):
        n = self.num_real_rows
        if self.num_loops < 1:  # NOTE: explicit; nothing downstream may turn a 0 into 1
            raise ValueError(f"step {self.step_id}: a plan runs at least one loop, got {self.num_loops}")
        sizes = {len(self.requests), len(self.token_ranges), len(self.emits), len(self.row_loops),
                 len(self.input_on_device)}
        if sizes != {n} or n > self.row_bucket or self.num_real_tokens > self.token_bucket:
            raise ValueError(f"step {self.step_id}: inconsistent plan ({n} rows, bucket {self.row_bucket}, "
                             f"{self.num_real_tokens} tokens, bucket {self.token_bucket})")

    @property
    def loop_end(self) -> int:
        return self.loop_begin + self.num_loops

    @property
    def is_per_loop(self) -> bool:
        """A submission of a per-loop decode series: fewer loops than some row's token needs."""
        return self.kind is StepKind.DECODE and (self.loop_begin > 0
                                                 or self.num_loops < max(self.row_loops, default=0))

    def apply_dispatch(self) -> None:
        """Count the plan as dispatched (Scheduler.schedule): its positions as computed, its
        sampled tokens as pending. A per-loop submission's rows change at its update instead
        (the device decides who emits)."""
        if self.is_per_loop:
            return
        for request, (_, end), emits in zip(self.requests, self.token_ranges, self.emits):
            request.num_computed_tokens = end
            if emits:
                request.num_pending_tokens += 1
                request.phase = RequestPhase.DECODING

    def input_token_ids(self) -> list[int]:
        """The real tokens of the step, packed in row order (known ones: read before any row
        has an input on the device)."""
        return [t for r, (s, e) in zip(self.requests, self.token_ranges) for t in r.token_ids(s, e)]

    def positions(self) -> list[int]:
        return [p for s, e in self.token_ranges for p in range(s, e)]


@dataclass
class StepOutput:
    token_ids: list[int | None]    # per real row: the sampled token, None where the row emits none
    exit_loops: list[int | None]   # per real row: loops its token ran (read where a token is given)

    def check(self, plan: StepPlan) -> None:
        """A one-line ValueError unless this is an output of `plan`: a token and an exit loop per
        real row, a token for every row that emits."""
        n = plan.num_real_rows
        if len(self.token_ids) != n or len(self.exit_loops) != n:
            raise ValueError(f"step {plan.step_id}: output has {len(self.token_ids)} tokens and "
                             f"{len(self.exit_loops)} exit loops for {n} real rows")
        for i, emits in enumerate(plan.emits):
            if emits and self.token_ids[i] is None:
                raise ValueError(f"step {plan.step_id}: row {i} ({plan.requests[i].request_id}) "
                                 "must emit a token")
            if self.token_ids[i] is not None and self.exit_loops[i] is None:
                raise ValueError(f"step {plan.step_id}: row {i} has a token but no exit loop")
