"""Scheduler: plans every step of the engine (pure Python over ints and lists, no JAX).

The engine loop is `plan = schedule(); output = runner.run(plan); update(plan, output)`;
one plan is in flight at a time (schedule() twice without update() is an error).

Vocabulary:
- A PREFILL step packs prompt chunks of up to `max_prefill_rows` requests, concatenated
  without padding (`max_prefill_tokens` real tokens at most, padded to a token bucket). A
  request whose prompt exceeds the budget is prefilled in several chunks (PREFILLING phase).
- A DECODE step feeds one token per row. Fused (the default): every row is fixed-depth, so
  the submission runs all its loops and every row emits a token: one submission per output
  token. Per-loop: if any row is adaptive (or `fused_decode=False`), the rows of one token
  run as a series of one-loop submissions (loop_begin = 0, 1, ...) with the same rows
  minus those that emitted; prefill steps may run between them.
- The prefill share: a decode submission of L loops allows L x max_prefill_batches_before_decode
  prefill steps before the next decode (just max_prefill_batches_before_decode with
  `prefill_share_per_loop=False`), so prompt work keeps the share it had without fusion.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from loopjax.block_manager import BlockManager
from loopjax.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestPhase


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


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16                   # tokens per KV page
    num_pages: int = 1024                 # pages in the pool
    max_num_rows: int = 64                # admitted requests at once = rows of a decode step
    decode_row_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # capped by max_num_rows
    max_prefill_tokens: int = 2048        # real tokens per prefill step (chunked above it)
    prefill_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # capped likewise
    max_prefill_rows: int = 8             # requests packed into one prefill step
    max_context_len: int = 4096           # prompt + generated tokens of one request
    max_prefill_batches_before_decode: int = 1  # prefill steps per decode step (x loops, see below)
    prefill_share_per_loop: bool = True   # a decode step of L loops allows L x the prefill steps
    num_loops: int = 4                    # default depth of a request's tokens (the model's)
    max_loops: int | None = None          # largest depth a request may ask for; None = num_loops
    fused_decode: bool = True             # fixed-depth rows run all loops in one submission

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

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Decode row counts that are compiled; the last is max_num_rows."""
        return _capped(self.decode_row_buckets, self.max_num_rows)

    @property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        return _capped(self.decode_row_buckets, self.max_prefill_rows)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Packed prefill token counts that are compiled; the last is max_prefill_tokens."""
        return _capped(self.prefill_token_buckets, self.max_prefill_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
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

    def prefill_share(self, num_loops: int) -> int:
        """Prefill steps allowed after a decode submission of num_loops loops."""
        per_loop = num_loops if self.prefill_share_per_loop else 1
        return per_loop * self.max_prefill_batches_before_decode


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

    def __post_init__(self):
        n = self.num_real_rows
        if self.num_loops < 1:  # NOTE: explicit; nothing downstream may turn a 0 into 1
            raise ValueError(f"step {self.step_id}: a plan runs at least one loop, got {self.num_loops}")
        if not (len(self.requests) == len(self.token_ranges) == len(self.emits) == len(self.row_loops)
                == n <= self.row_bucket) or self.num_real_tokens > self.token_bucket:
            raise ValueError(f"step {self.step_id}: inconsistent plan ({n} rows, bucket {self.row_bucket}, "
                             f"{self.num_real_tokens} tokens, bucket {self.token_bucket})")

    @property
    def loop_end(self) -> int:
        return self.loop_begin + self.num_loops

    def input_token_ids(self) -> list[int]:
        """The real tokens of the step, packed in row order."""
        return [t for r, (s, e) in zip(self.requests, self.token_ranges) for t in r.token_ids(s, e)]

    def positions(self) -> list[int]:
        return [p for s, e in self.token_ranges for p in range(s, e)]


@dataclass
class StepOutput:
    token_ids: list[int | None]    # per real row: the sampled token, None where the row emits none
    exit_loops: list[int | None]   # per real row: loops its token ran (read where a token is given)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.block_manager = BlockManager(config.num_pages, config.page_size)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()  # preempted first (by arrival), then new ones
        self.running: list[Request] = []        # admitted (PREFILLING / DECODING), by arrival
        self._series: list[Request] = []        # per-loop decode: rows of the token in progress
        self._series_loop = 0                   # next loop_begin of the series
        self._prefills_since_decode = 0
        self._prefill_allowance = config.max_prefill_batches_before_decode
        self._in_flight: StepPlan | None = None
        self._num_arrivals = 0
        self.num_steps = self.num_prefill_steps = self.num_decode_steps = 0
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests
    def add(self, request: Request) -> None:
        """Queue a request; a request that can never run raises a one-line ValueError."""
        cfg, rid = self.config, request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r}: id already in use")
        if request.phase is not RequestPhase.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid!r}: already scheduled once; submit a new Request")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        if n + 1 > cfg.max_context_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens leaves no room to generate "
                             f"within max_context_len={cfg.max_context_len}")
        if n + 1 > cfg.capacity_tokens:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens does not fit the KV pool "
                             f"({cfg.num_pages} pages x {cfg.page_size} = {cfg.capacity_tokens} tokens)")
        if request.max_loops is None:
            request.max_loops = cfg.num_loops
        if not 1 <= request.max_loops <= cfg.loop_cap:
            raise ValueError(f"request {rid!r}: loops must be in [1, {cfg.loop_cap}], "
                             f"got {request.max_loops}")
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        request.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        self.requests[rid] = request
        self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any phase with reason "abort"; its pages return at once."""
        return self.finish(request_id, FINISH_ABORT)

    def finish(self, request_id: str, reason: str) -> Request | None:
        """Finish a request now (e.g. a stop string the engine found); None if unknown/finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self._retire(request, reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        phases = [r.phase for r in self.running]
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_prefilling": phases.count(RequestPhase.PREFILLING),
            "num_decoding": phases.count(RequestPhase.DECODING),
            "num_free_pages": self.block_manager.num_free_pages,
            "num_used_pages": self.block_manager.num_used_pages,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "num_decode_steps": self.num_decode_steps,
        }

    # ---------------------------------------------------------------- planning
    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when no request is unfinished.

        The rule: decode runs when some row is decoding and the prefill share granted by the
        last decode step is used up, or when no prefill work can be placed; otherwise one
        prefill step packs chunks FCFS (partially prefilled requests first, then the queue).
        Admission needs free pages for the whole chunk; when a decode row (or a partially
        prefilled request) needs pages the pool lacks, the most recently arrived running
        requests are preempted by recompute.
        """
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        if not self.requests:
            return None
        preempted: list[Request] = []
        plan = None
        for _ in range(2):  # a decode that preempted all its rows falls back to prefill once
            decode_ready = any(r.phase is RequestPhase.DECODING for r in self.running)
            if not decode_ready or self._prefills_since_decode < self._prefill_allowance:
                plan = self._plan_prefill(preempted)
            if plan is None and decode_ready:
                plan = self._plan_decode(preempted)
            if plan is not None:
                break
        if plan is None:  # NOTE: unreachable by the rule above; a stall must not spin silently
            raise RuntimeError(f"scheduler stalled with {len(self.requests)} unfinished requests")
        self._in_flight = plan
        self.num_steps += 1
        return plan

    def _plan_prefill(self, preempted: list[Request]) -> StepPlan | None:
        cfg = self.config
        budget = cfg.max_prefill_tokens
        rows: list[Request] = []
        ranges: list[tuple[int, int]] = []
        blocked = False  # an admitted request waits for pages: no newcomer may overtake it
        for request in list(self.running):  # partially prefilled first, oldest first
            if request.phase is not RequestPhase.PREFILLING:
                continue
            if len(rows) == cfg.max_prefill_rows or budget == 0:
                break
            start = request.num_computed_tokens
            end = min(request.num_tokens, start + budget)
            if not self._reserve(request, end, preempted, rows):
                blocked = True
                break
            rows.append(request)
            ranges.append((start, end))
            budget -= end - start
        while (not blocked and self.waiting and len(rows) < cfg.max_prefill_rows and budget > 0
               and len(self.running) < cfg.max_num_rows):
            request = self.waiting[0]
            end = min(request.num_tokens, budget)
            if not self.block_manager.can_fit(request, end):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.block_manager.allocate(request, end)
            request.phase = RequestPhase.PREFILLING
            bisect.insort(self.running, request, key=lambda r: r.arrival_order)
            rows.append(request)
            ranges.append((0, end))
            budget -= end
        if not rows:
            return None
        self._prefills_since_decode += 1
        self.num_prefill_steps += 1
        num_tokens = sum(e - s for s, e in ranges)
        row_loops = tuple(r.max_loops for r in rows)
        return StepPlan(
            step_id=self.num_steps, kind=StepKind.PREFILL, requests=tuple(rows),
            token_ranges=tuple(ranges), emits=tuple(e == r.num_tokens for r, (_, e) in zip(rows, ranges)),
            row_loops=row_loops, loop_begin=0, num_loops=max(row_loops), num_real_rows=len(rows),
            row_bucket=cfg.prefill_row_bucket(len(rows)), num_real_tokens=num_tokens,
            token_bucket=cfg.token_bucket(num_tokens), preempted=tuple(preempted))

    def _plan_decode(self, preempted: list[Request]) -> StepPlan | None:
        cfg = self.config
        if not self._series:  # a new token: every decoding request joins, oldest first
            rows: list[Request] = []
            for request in list(self.running):
                if request.phase is not RequestPhase.DECODING:
                    continue  # prefilling, or preempted by an older row just now
                if self._reserve(request, request.num_tokens, preempted, rows):
                    rows.append(request)
                else:  # even preempting every newer request leaves too few pages
                    self._preempt(request, preempted)
            if not rows:
                return None
            fused = cfg.fused_decode and not any(r.adaptive for r in rows)
            if not fused:
                self._series, self._series_loop = rows, 0
        else:
            rows, fused = self._series, False
        row_loops = tuple(r.max_loops for r in rows)
        if fused:  # all loops of every row in one submission; every row emits
            loop_begin, num_loops = 0, max(row_loops)
            emits = (True,) * len(rows)
        else:
            loop_begin, num_loops = self._series_loop, 1
            emits = tuple(loop_begin + 1 >= n for n in row_loops)
        self._prefills_since_decode = 0
        self._prefill_allowance = cfg.prefill_share(num_loops)
        self.num_decode_steps += 1
        bucket = cfg.row_bucket(len(rows))
        return StepPlan(
            step_id=self.num_steps, kind=StepKind.DECODE, requests=tuple(rows),
            token_ranges=tuple((r.num_tokens - 1, r.num_tokens) for r in rows), emits=emits,
            row_loops=row_loops, loop_begin=loop_begin, num_loops=num_loops,
            num_real_rows=len(rows), row_bucket=bucket, num_real_tokens=len(rows),
            token_bucket=bucket, preempted=tuple(preempted))

    def _reserve(self, request: Request, num_tokens: int, preempted: list[Request],
                 protected: list[Request]) -> bool:
        """Pages for num_tokens positions of an admitted request, preempting newer running
        requests (most recent first) if that is enough; False (nothing preempted) otherwise."""
        bm = self.block_manager
        needed = bm.num_new_pages(request, num_tokens)
        if not bm.can_allocate(needed):
            newer = [r for r in self.running
                     if r.arrival_order > request.arrival_order and r not in protected]
            if bm.num_free_pages + sum(len(r.page_ids) for r in newer) < needed:
                return False
            while not bm.can_allocate(needed):
                self._preempt(newer.pop(), preempted)
        bm.allocate(request, num_tokens)
        return True

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        """Recompute later: pages back, generated tokens kept, queued by arrival at the front."""
        self.block_manager.free(request)
        self.running.remove(request)
        if request in self._series:
            self._series.remove(request)
        request.phase = RequestPhase.PREEMPTED
        request.num_computed_tokens = 0
        request.num_loops_done = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        i = 0
        while (i < len(self.waiting) and self.waiting[i].phase is RequestPhase.PREEMPTED
               and self.waiting[i].arrival_order < request.arrival_order):
            i += 1
        self.waiting.insert(i, request)
        preempted.append(request)

    # ---------------------------------------------------------------- results
    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Apply a step's output; returns the requests that got a token or finished, in row order."""
        if plan is not self._in_flight:
            raise ValueError("update() expects the plan returned by the last schedule()")
        n = plan.num_real_rows
        if len(output.token_ids) != n or len(output.exit_loops) != n:
            raise ValueError(f"step {plan.step_id}: output has {len(output.token_ids)} tokens and "
                             f"{len(output.exit_loops)} exit loops for {n} real rows")
        for i, emits in enumerate(plan.emits):
            if emits and output.token_ids[i] is None:
                raise ValueError(f"step {plan.step_id}: row {i} ({plan.requests[i].request_id}) "
                                 "must emit a token")
            if output.token_ids[i] is not None and output.exit_loops[i] is None:
                raise ValueError(f"step {plan.step_id}: row {i} has a token but no exit loop")
        self._in_flight = None
        now = self.clock()
        changed = []
        for request, (_, end), token, exit_loop in zip(plan.requests, plan.token_ranges,
                                                        output.token_ids, output.exit_loops):
            if request.is_finished or request.phase is RequestPhase.PREEMPTED:
                continue  # aborted/finished after planning
            if plan.kind is StepKind.PREFILL:
                request.num_prefill_submissions += 1
                request.num_computed_tokens = end
                if end < request.num_tokens:
                    continue  # more prompt chunks to come
                request.phase = RequestPhase.DECODING
            else:
                request.num_decode_submissions += 1
                if token is None:
                    request.num_loops_done = plan.loop_end
                    continue
                request.num_computed_tokens = end
                request.num_loops_done = 0
                request.num_decode_tokens += 1
            self._append(request, token, exit_loop, now)
            changed.append(request)
        if plan.kind is StepKind.DECODE and self._series:
            # Rows still mid-token continue at loop_end; those that emitted left the series.
            self._series = [r for r in self._series
                            if r.phase is RequestPhase.DECODING and r.num_loops_done == plan.loop_end]
            self._series_loop = plan.loop_end if self._series else 0
        return changed

    def _append(self, request: Request, token: int, exit_loop: int, now: float) -> None:
        request.output_token_ids.append(token)
        request.exit_loops.append(exit_loop)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        max_tokens = request.max_tokens
        if token in request.stop_token_ids:
            self._retire(request, FINISH_STOP)
        elif max_tokens is not None and request.num_output_tokens >= max_tokens:
            self._retire(request, FINISH_LENGTH)
        elif request.num_tokens >= self.config.max_seq_len:
            self._retire(request, FINISH_LENGTH)

    def _retire(self, request: Request, reason: str) -> None:
        self.block_manager.free(request)
        if request in self.running:
            self.running.remove(request)
        if request in self._series:
            self._series.remove(request)
        if request.phase in (RequestPhase.WAITING, RequestPhase.PREEMPTED):
            self.waiting.remove(request)
        request.phase = RequestPhase.FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()
        del self.requests[request.request_id]
