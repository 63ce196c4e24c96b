"""A fake runner for scheduler tests: arithmetic checkable by hand, pool checks built in.

- Next token = (last token of the row's context + 1) % vocab_size.
- Exit loop: a fixed-depth row exits at its row_loops; an adaptive row exits at
  1 + (last token % row_loops) (hand-checkable, and not the same for every row).
- The fake keeps a simulated KV pool. A slot holds what a real model's KV is a function of:
  (identity, position, every token up to it), where identity is (cache_salt, loops) for a
  request whose pages may be shared and its own id for one whose pages may not (cache_salt
  None, or adaptive). Every step writes the fed tokens into their slots through the row's
  page list and reads the row's whole context back through it, so a page that is shared
  wrongly, freed too early or mapped wrong fails the test at once. Given the block manager,
  it also asserts a step never writes a page that another request holds or the prefix cache
  published. It checks the per-loop carry too: a row's loops arrive in order.
- Like the device, it runs a plan when it is dispatched (`run`), in dispatch order, and keeps
  each request's last sampled token: a row whose input is on the device (a token still in
  flight, `StepPlan.input_on_device`) reads it from there, never from the host.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loopjax.block_manager import BlockManager
from loopjax.request import Request
from loopjax.scheduler import Scheduler, StepKind, StepOutput, StepPlan


def adaptive_exit(last_token: int, row_loops: int) -> int:
    return 1 + last_token % row_loops


class FakeRunner:
    def __init__(self, page_size: int, num_pages: int, vocab_size: int = 97,
                 block_manager: BlockManager | None = None):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        self.pool: list[tuple | None] = [None] * (num_pages * page_size)
        self.loops_done: dict[str, int] = {}  # per-loop decode carry: loops run for the pending token
        self.last_sampled: dict[str, int] = {}  # the device's last-token slots, by request
        self.emitted: dict[str, int] = {}       # tokens sampled per request (dropped ones too)
        self.num_submissions = 0

    def run(self, plan: StepPlan) -> StepOutput:
        assert plan.num_loops >= 1 and plan.num_real_rows == len(plan.requests) <= plan.row_bucket
        assert plan.num_real_tokens == sum(e - s for s, e in plan.token_ranges) <= plan.token_bucket
        self.num_submissions += 1
        for request in plan.preempted:
            self.loops_done.pop(request.request_id, None)
        tokens: list[int | None] = []
        exits: list[int | None] = []
        for i, request in enumerate(plan.requests):
            start, end = plan.token_ranges[i]
            context = self._write_and_read(request, start, end, plan.input_on_device[i])
            last = context[-1]
            depth = plan.row_loops[i]
            exit_loop = adaptive_exit(last, depth) if request.adaptive else depth
            if plan.kind is StepKind.PREFILL:
                assert plan.loop_begin == 0 and plan.num_loops >= depth
                done = end == request.num_tokens
            else:
                rid = request.request_id
                assert plan.loop_begin == self.loops_done.get(rid, 0), "per-loop carry out of order"
                assert plan.loop_begin < exit_loop, "a row that exited was planned again"
                done = exit_loop <= plan.loop_end
                self.loops_done[rid] = 0 if done else plan.loop_end
            assert done or not plan.emits[i], f"row {i} must emit but has loops left"
            tokens.append((last + 1) % self.vocab_size if done else None)
            exits.append(exit_loop if done else None)
            if done:
                self.last_sampled[request.request_id] = tokens[-1]
                self.emitted[request.request_id] = self.emitted.get(request.request_id, 0) + 1
        return StepOutput(token_ids=tokens, exit_loops=exits)

    def _write_and_read(self, request: Request, start: int, end: int, on_device: bool) -> list[int]:
        rid, size = request.request_id, self.page_size
        assert len(request.page_ids) * size >= end, f"{rid}: pages do not cover position {end - 1}"
        shareable = request.cache_salt is not None and not request.adaptive
        identity = (request.cache_salt, request.max_loops) if shareable else ("private", rid)
        if on_device:  # the input is the token sampled by a step the host has not read yet
            assert end - 1 == request.num_tokens, f"{rid}: input {end - 1} is not the pending token"
            tokens = tuple(request.token_ids(0, end - 1)) + (self.last_sampled[rid],)
        else:
            assert end <= request.num_tokens, f"{rid}: input {end - 1} is not known on the host"
            tokens = tuple(request.token_ids(0, end))
        slots = [request.page_ids[p // size] * size + p % size for p in range(end)]
        bm = self.block_manager
        for p in range(start, end):
            page = request.page_ids[p // size]
            if bm is not None:
                assert bm.ref_count(page) == 1, f"{rid}: writes position {p} into shared page {page}"
                assert not bm.is_published(page), f"{rid}: writes position {p} into cached page {page}"
            self.pool[slots[p]] = (identity, p, tokens[:p + 1])
        for p in range(end):
            entry = self.pool[slots[p]]
            assert entry == (identity, p, tokens[:p + 1]), f"{rid}: slot of position {p} holds {entry}"
        return list(tokens)


VOCAB = 97  # the fake runner's vocabulary in the scheduler tests


def setup(config):
    """A scheduler and a fake runner sharing its block manager."""
    sched = Scheduler(config)
    return sched, FakeRunner(config.page_size, config.num_pages, VOCAB, sched.block_manager)


def step(sched, runner):
    """One synchronous schedule -> run -> update; returns the plan."""
    plan = sched.schedule()
    sched.update(plan, runner.run(plan))
    return plan


@dataclass
class Trace:
    kinds: str = ""                                     # one letter per step: P(refill) or D(ecode)
    rows: list[list[str]] = field(default_factory=list)  # request ids per step, row order
    loops: list[int] = field(default_factory=list)       # num_loops per step
    first_token_step: dict[str, int] = field(default_factory=dict)
    finished: dict[str, Request] = field(default_factory=dict)


def drive(scheduler: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]] | None = None,
          *, max_steps: int = 10_000, before_step=None, pipelined: bool = False) -> Trace:
    """Run schedule -> run -> update to completion; arrivals[k] are added before step k.

    pipelined: as the engine with async scheduling, each step plans (and runs) the next plan
    before it updates the oldest one in flight, whenever `can_schedule_ahead()` allows; a
    step that could not plan ahead records "|" in `trace.kinds`. Checks the pool against
    the live requests after every step; before_step(k) may act (abort, finish) before step k
    is planned."""
    arrivals = dict(arrivals or {})
    trace = Trace()
    in_flight: deque = deque()
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            scheduler.add(request)
        if before_step is not None:
            before_step(step)
        while not in_flight or (pipelined and len(in_flight) == 1 and scheduler.can_schedule_ahead()):
            plan = scheduler.schedule()
            if plan is None:
                break
            trace.kinds += "P" if plan.kind is StepKind.PREFILL else "D"
            trace.rows.append([r.request_id for r in plan.requests])
            trace.loops.append(plan.num_loops)
            in_flight.append((plan, runner.run(plan)))
        if pipelined and len(in_flight) == 1 and scheduler.has_unfinished():
            trace.kinds += "|"  # the next plan waits for this update
        if not in_flight:
            if not arrivals:
                return trace
            trace.kinds += "-"  # idle step
            trace.rows.append([])
            trace.loops.append(0)
            continue
        for request in scheduler.update(*in_flight.popleft()):
            trace.first_token_step.setdefault(request.request_id, step)
            if request.is_finished:
                trace.finished[request.request_id] = request
        scheduler.block_manager.check(scheduler.requests.values())
    raise AssertionError(f"not done after {max_steps} steps")
