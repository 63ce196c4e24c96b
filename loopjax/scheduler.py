"""Scheduler: plans every step of the engine (pure Python over ints and lists, no JAX).

The engine loop is `plan = schedule(); output = runner.run(plan); update(plan, output)`.
`schedule()` applies a plan's effect on the requests' positions at once (the plan counts as
dispatched): `num_computed_tokens` covers the positions it writes, and a row that samples a
token holds it as pending (`Request.num_pending_tokens`) until `update()` reads it.

Vocabulary:
- A PREFILL step packs prompt chunks of up to `max_prefill_rows` requests, concatenated
  without padding (`max_prefill_tokens` real tokens at most, padded to a token bucket). A
  request whose prompt exceeds the budget is prefilled in several chunks (PREFILLING phase).
  The queue's head is admitted (FCFS) only when the free pages hold its whole context, not
  just a chunk: else older rows' growth preempts it before it completes, again and again.
- A DECODE step feeds one token per row. Fused (the default): every row is fixed-depth, so
  the submission runs all its loops and every row emits a token: one submission per output
  token. Per-loop: if any row is adaptive (or `fused_decode=False`), the rows of one token
  run as a series of one-loop submissions (loop_begin = 0, 1, ...) with the same rows
  minus those that emitted; prefill steps may run between them. A per-loop submission
  changes its rows' state only at its update (the device decides which rows emit).
- The prefill share (step_plan.PrefillShare): a decode submission that runs L loops allows
  L x max_prefill_batches_before_decode prefill steps before the next decode (just
  max_prefill_batches_before_decode with `prefill_share_per_loop=False`), so prompt work keeps
  the share it had without fusion; a fixed-depth fused submission runs its compiled loop count
  (`loop_count`). While no row waits to decode, the share starts over (the configured depth's).
- Prefix cache (`enable_prefix_caching`, loopjax/prefix_cache.py): an admitted request first
  takes the cached pages of its prefix and starts with `num_computed_tokens` = their length,
  so its first chunk (and the runner's positions and slots) starts after them; every update
  publishes the full pages below the end of the rows it applies (known tokens, KV written).

Planning ahead (async scheduling, docs/design.md "The engine loop"): with one plan in flight,
`schedule()` may plan the next when `can_schedule_ahead()` (no per-loop series, fused
fixed-depth decode); a row with a pending token then feeds it from the device
(`StepPlan.input_on_device`). A request certain to finish in flight is not planned again; one
that finishes unexpectedly may already be in the next plan, whose token for it is dropped (its
pages return at once: the device runs submissions in order, so only later steps reuse them).
Ahead, a shortfall of pages returns None: preemption keeps the synchronous order.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from loopjax.block_manager import BlockManager
from loopjax.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestPhase
from loopjax.step_plan import PrefillShare, SchedulerConfig, StepKind, StepOutput, StepPlan
from loopjax.wording import counted

__all__ = ["Scheduler", "SchedulerConfig", "StepKind", "StepOutput", "StepPlan"]


class _NeedsUpdate(Exception):
    """Planning ahead met a case that needs the update of the plan in flight (pages)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 loop_count: Callable[[int], int] | None = None):
        """loop_count(n): the loops a fixed-depth fused submission of n loops runs (the runner's
        compiled count); None: n."""
        self.config = config
        self.clock = clock
        self.block_manager = BlockManager(config.num_pages, config.page_size,
                                          enable_prefix_cache=config.enable_prefix_caching,
                                          decode_page_planes=config.decode_page_planes)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()  # preempted first (by arrival), then new ones
        self.running: list[Request] = []        # admitted (PREFILLING / DECODING), by arrival
        self._series: list[Request] = []        # per-loop decode: rows of the token in progress
        self._series_loop = 0                   # next loop_begin of the series
        self._share = PrefillShare(config, loop_count)
        self._in_flight: deque[StepPlan] = deque()  # planned, not yet updated (oldest first)
        self._unreported: list[Request] = []  # preempted, not yet in a plan (StepPlan.preempted)
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
        cfg.check_request(request)
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

    def drop(self, plan: StepPlan) -> list[Request]:
        """Forget the newest plan, which never ran (its dispatch raised): schedule() counted it
        as dispatched, so its unfinished requests are aborted; returns them."""
        if not self._in_flight or plan is not self._in_flight[-1]:
            raise ValueError("drop() expects the newest plan returned by schedule()")
        self._in_flight.pop()
        dropped = [r for r in dict.fromkeys(plan.requests) if not r.is_finished]
        for request in dropped:
            self._retire(request, FINISH_ABORT)
        return dropped

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int | float]:
        """Counts of the queue, the steps and the pool (BlockManager.stats)."""
        phases = [r.phase for r in self.running]
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_prefilling": phases.count(RequestPhase.PREFILLING),
            "num_decoding": phases.count(RequestPhase.DECODING),
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "num_decode_steps": self.num_decode_steps,
            **self.block_manager.stats(),
        }

    # ---------------------------------------------------------------- planning
    def can_schedule_ahead(self) -> bool:
        """A plan is in flight and schedule() may plan the next one before its update: one
        plan in flight, no per-loop series running or due (module note, "Planning ahead")."""
        return (len(self._in_flight) == 1 and not self._series and self.config.fused_decode
                and not any(r.adaptive for r in self.running))

    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when nothing can be planned now: no request is unfinished,
        or (planning ahead) the next plan needs the update of the one in flight.

        The rule: decode runs when some row is decoding and the prefill share granted by the
        last decode step is used up, or when no prefill work can be placed; otherwise one
        prefill step packs chunks FCFS (partially prefilled requests first, then the queue).
        Admission shares the request's cached prefix pages and needs free pages for the rest
        of its context (its first chunk starts after them); when a decode row needs pages the
        pool lacks, the most recently arrived running requests are preempted by recompute (a
        partially prefilled request is the newest running one: short of pages, it waits).
        """
        ahead = bool(self._in_flight)
        if ahead and not self.can_schedule_ahead():
            raise RuntimeError("schedule() called again before update() of the previous plan")
        if not self.requests:
            return None
        preempted = self._unreported  # NOTE: kept if this raises (Ctrl-C): the next plan reports them
        plan = None
        try:
            for _ in range(2):  # a decode that preempted all its rows falls back to prefill once
                decode_ready = any(self._decodes_next(r) for r in self.running)
                if not decode_ready:  # NOTE: a burst's prompts are admitted before its rows decode
                    self._share.restart(self.config)
                if not decode_ready or not self._share.used_up:
                    plan = self._plan_prefill(preempted, ahead)
                if plan is None and decode_ready:
                    plan = self._plan_decode(preempted, ahead)
                if plan is not None:
                    break
        except _NeedsUpdate:
            return None  # NOTE: rows reserved so far keep their pages; they need them next anyway
        if plan is None:
            if ahead:
                return None
            # NOTE: unreachable by the rule above; a stall must not spin silently
            raise RuntimeError(f"scheduler stalled with {counted(len(self.requests), 'unfinished request')}")
        plan.apply_dispatch()
        self._in_flight.append(plan)
        self._unreported = []
        self.num_steps += 1
        return plan

    def _decodes_next(self, request: Request) -> bool:
        """A decoding request that may still need a token after the steps in flight."""
        if request.phase is not RequestPhase.DECODING:
            return False
        if request.num_pending_tokens == 0:
            return True
        max_tokens = request.max_tokens
        return ((max_tokens is None or request.num_output_tokens + request.num_pending_tokens < max_tokens)
                and request.num_planned_tokens < self.config.max_seq_len)

    def _plan_prefill(self, preempted: list[Request], ahead: bool) -> StepPlan | None:
        cfg = self.config
        budget = cfg.max_prefill_tokens
        rows: list[Request] = []
        ranges: list[tuple[int, int]] = []
        # NOTE: a partial prefill is the newest running request (FCFS; a chunk takes the budget), so
        # short of pages it waits for older rows to finish or preempt it; no newcomer overtakes it
        blocked = False
        for request in list(self.running):  # partially prefilled first, oldest first
            if request.phase is not RequestPhase.PREFILLING:
                continue
            if len(rows) == cfg.max_prefill_rows or budget == 0:
                break
            start = request.num_computed_tokens
            end = min(request.num_tokens, start + budget)
            if not self._reserve(request, end, preempted, rows, ahead):
                blocked = True
                break
            rows.append(request)
            ranges.append((start, end))
            budget -= end - start
        while (not blocked and self.waiting and len(rows) < cfg.max_prefill_rows and budget > 0
               and len(self.running) < cfg.max_num_rows):
            request = self.waiting[0]
            hits = self.block_manager.match(request)  # cached prefix pages (prefix cache on)
            start = len(hits) * cfg.page_size         # < num_tokens: the last token is computed
            end = min(request.num_tokens, start + budget)
            split = request.whole_prefill and end < request.num_tokens <= cfg.max_prefill_tokens
            # NOTE: room for the whole context, not just this chunk, else older rows' growth
            # preempts it before it completes, again and again (recompute ping-pong)
            if split or not self.block_manager.can_admit(hits, request.num_tokens):
                break  # FCFS: nobody overtakes the head of the queue (Request.whole_prefill waits)
            self.waiting.popleft()
            self.block_manager.admit(request, hits, end)
            request.num_computed_tokens = start
            request.phase = RequestPhase.PREFILLING
            bisect.insort(self.running, request, key=lambda r: r.arrival_order)
            rows.append(request)
            ranges.append((start, end))
            budget -= end - start
        if not rows:
            return None
        self._share.num_prefills += 1
        self.num_prefill_steps += 1
        num_tokens = sum(e - s for s, e in ranges)
        row_loops = tuple(r.max_loops for r in rows)
        return StepPlan(
            step_id=self.num_steps, kind=StepKind.PREFILL, requests=tuple(rows),
            token_ranges=tuple(ranges), emits=tuple(e == r.num_tokens for r, (_, e) in zip(rows, ranges)),
            row_loops=row_loops, loop_begin=0, num_loops=max(row_loops), num_real_rows=len(rows),
            row_bucket=cfg.prefill_row_bucket(len(rows)), num_real_tokens=num_tokens,
            token_bucket=cfg.token_bucket(num_tokens), preempted=tuple(preempted),
            input_on_device=(False,) * len(rows))

    def _plan_decode(self, preempted: list[Request], ahead: bool) -> StepPlan | None:
        cfg = self.config
        if not self._series:  # a new token: every decoding request joins, oldest first
            rows: list[Request] = []
            for request in list(self.running):
                if not self._decodes_next(request):
                    continue  # prefilling, preempted by an older row just now, or finishing
                if self._reserve(request, request.num_planned_tokens, preempted, rows, ahead):
                    rows.append(request)
                else:  # NOTE: only the newest row gets here, and preempts itself (vLLM's order):
                    # any newer request holds a page or decode slot of its own, room for this one
                    assert request is self.running[-1], f"{request.request_id}: preempted before newer rows"
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
        self._share.grant(cfg, num_loops, fused=fused)
        self.num_decode_steps += 1
        bucket = cfg.row_bucket(len(rows))
        return StepPlan(
            step_id=self.num_steps, kind=StepKind.DECODE, requests=tuple(rows),
            token_ranges=tuple((r.num_planned_tokens - 1, r.num_planned_tokens) for r in rows),
            emits=emits, row_loops=row_loops, loop_begin=loop_begin, num_loops=num_loops,
            num_real_rows=len(rows), row_bucket=bucket, num_real_tokens=len(rows),
            token_bucket=bucket, preempted=tuple(preempted),
            input_on_device=tuple(r.num_pending_tokens > 0 for r in rows))

    def _reserve(self, request: Request, num_tokens: int, preempted: list[Request],
                 protected: list[Request], ahead: bool) -> bool:
        """Pages for num_tokens positions of an admitted request, preempting newer running
        requests (most recent first) if that is enough; False (nothing preempted) otherwise.
        Planning ahead, a shortfall raises _NeedsUpdate: the synchronous order decides."""
        bm = self.block_manager
        if bm.num_new_pages(request, num_tokens) == 0:
            return True  # most decode steps: the last page has room
        if not bm.can_fit(request, num_tokens):
            if ahead:
                raise _NeedsUpdate
            newer = [r for r in self.running
                     if r.arrival_order > request.arrival_order and r not in protected]
            if not bm.can_fit(request, num_tokens, reclaim=newer):
                return False  # NOTE: pages shared with older requests would not come back
            while not bm.can_fit(request, num_tokens):
                self._preempt(newer.pop(), preempted)
        bm.allocate(request, num_tokens)
        return True

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        """Recompute later: pages back, generated tokens kept, queued by arrival at the front."""
        assert request.num_pending_tokens == 0, f"{request.request_id}: preempted with a token in flight"
        self.block_manager.free(request)
        self.running.remove(request)
        if request in self._series:
            self._series.remove(request)
        request.phase = RequestPhase.PREEMPTED
        request.num_computed_tokens = 0
        request.num_loops_done = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        after = (i for i, r in enumerate(self.waiting)  # the preempted older ones
                 if r.phase is not RequestPhase.PREEMPTED or r.arrival_order > request.arrival_order)
        self.waiting.insert(next(after, len(self.waiting)), request)
        preempted.append(request)

    # ---------------------------------------------------------------- results
    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Apply a step's output; returns the requests that got a token or finished, in row order.
        Plans are updated in the order they were planned; a row whose request finished (or
        was aborted) since its plan was made is skipped: its token is dropped."""
        if not self._in_flight or plan is not self._in_flight[0]:
            raise ValueError("update() expects the oldest plan returned by schedule() and not updated")
        output.check(plan)
        self._in_flight.popleft()
        now = self.clock()
        changed = []
        decode, per_loop = plan.kind is StepKind.DECODE, plan.is_per_loop
        for request, (_, end), token, exit_loop in zip(plan.requests, plan.token_ranges,
                                                        output.token_ids, output.exit_loops):
            if request.is_finished or request.phase is RequestPhase.PREEMPTED:
                continue  # aborted/finished after planning
            if decode:
                request.num_decode_submissions += 1
            else:
                request.num_prefill_submissions += 1
            if per_loop:  # the state changes now (see StepPlan.apply_dispatch)
                if token is None:
                    request.num_loops_done = plan.loop_end
                    continue
                request.num_computed_tokens = end
                request.num_loops_done = 0
            # NOTE: published before _append may free the pages; positions < end have known tokens
            self.block_manager.publish(request, end)
            if token is None:
                continue  # more prompt chunks to come
            if decode:
                request.num_decode_tokens += 1
            if not per_loop:
                request.num_pending_tokens -= 1
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
