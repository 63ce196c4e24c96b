"""Background engine loop: one thread owns the Engine, asyncio callers submit and stream.

Contract:
- Every Engine call (add_request, abort, step, stats) runs in the engine thread
  (engine_thread.py), so the Engine needs no locks and all JAX work stays on one thread, but
  shutdown's, once that thread ended.
- Callers on the event loop `await submit(prompt_ids, params)`: it returns a
  `RequestStream` once the engine accepted the request, raises ValueError (one line) for
  bad input or a request_id still open, and `QueueFullError` while `max_waiting` accepted
  requests still wait for their first token (the bounded queue: the server answers 429).
  Nothing is queued on error; any other error of add_request (a bug) fails that request alone
  with a RuntimeError (500). `submit_all` admits several (an OpenAI request's prompts x n) all
  or none: a queue without room for all refuses them once.
- Each submission is its own engine request, `request_id#k` (k counts submissions), so that
  an ended request's late outputs and aborts never reach a new one under the same id;
  outputs carry the caller's id.
- Outputs reach the event loop in one `loop.call_soon_threadsafe` per engine step and are
  fed to per-request asyncio queues. Closing a stream early (client gone), cancelling its
  reader while it waits, or dropping it unclosed aborts its request: the engine thread frees
  its pages before its next step.
- The engine thread takes submissions and aborts from an inbox and answers on the event
  loop; an idle one may wait an admission window (`admission_window_s`) for a burst.
- `stats()` is a snapshot the engine thread refreshes after every turn of its loop.
- Metrics: requests_total counts the requests submit returned; each ends counted once, in
  requests_finished_total or requests_aborted_total. A submit that raises counts in neither;
  a full queue counts one rejection per submit / submit_all.
  Latencies run from the request's arrival (submit's arrival_time): TTFT counts at a first
  token, TPOT and e2e with a finished request (a stop string's too).
- A step that fails on the device (the Engine's StepFailedError) fails the requests it lost
  with a `RequestFailedError` (HTTP 500) and the loop serves on, when the engine made a fresh
  device state. When the engine thread dies (engine_thread.py), every open request gets an
  `EngineDeadError` (503), as do every later submit and /health; the engine's gauges read 0.
- `shutdown()` sets the stop event, joins the thread, delivers the outputs it made and fails
  the streams still open; the thread gone, it aborts their requests in the engine before its
  last stats snapshot.
This module imports neither JAX nor FastAPI; it works with any object that has the
Engine's add_request / abort / step / has_unfinished / stats methods.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from loopjax.engine_thread import (  # noqa: F401 (MAX_STEP_FAILURES: callers import it from here)
    MAX_STEP_FAILURES,
    EngineDeadError,
    EngineThread,
    RequestFailedError,
    one_line,
)
from loopjax.metrics import ServingMetrics
from loopjax.request_stream import RequestStream, StreamState, engine_id_of, request_id_of

log = logging.getLogger("loopjax.async_engine")


class QueueFullError(RuntimeError):
    """Too many requests wait for their first token; retry later (HTTP 429)."""


def check_seconds(name: str, value, *, zero_ok: bool) -> None:
    """Seconds the engine thread may wait: > 0 (>= 0 when `zero_ok`) and at most
    threading.TIMEOUT_MAX (a longer wait raises in the thread), or a one-line ValueError naming it."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not 0 <= value <= threading.TIMEOUT_MAX or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0 (seconds, at most "
                         f"{threading.TIMEOUT_MAX:g}), got {value!r}")


class AsyncEngine:
    def __init__(self, engine, *, max_waiting: int = 256, idle_timeout_s: float = 0.5,
                 admission_window_s: float = 0.0, metrics: ServingMetrics | None = None):
        # NOTE: max_waiting 0 would refuse every request with a 429 no retry passes; an idle
        # timeout <= 0 spins the idle thread; an infinite wait raises in the engine thread
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        check_seconds("idle_timeout_s", idle_timeout_s, zero_ok=False)
        check_seconds("admission_window_s", admission_window_s, zero_ok=True)
        self.engine = engine
        self.max_waiting = max_waiting  # accepted requests without a first token (queue bound)
        self.metrics = metrics or ServingMetrics()
        self.num_waiting = 0  # event-loop side count of requests without a first token
        self._streams: dict[str, StreamState] = {}  # event-loop side; open requests by request_id
        self._num_submitted = 0  # submissions so far: each one's engine id is unique
        self._pending: set[asyncio.Future] = set()  # event-loop side; admissions not answered yet
        self._worker = EngineThread(self, engine, idle_timeout_s=idle_timeout_s,
                                    admission_window_s=admission_window_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: dict = {}
        self._final_stats = False  # shutdown took the last snapshot: the thread's older ones are dropped

    # ------------------------------------------------------------ event-loop side
    @property
    def running(self) -> bool:
        return self._worker.running

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread, if anything."""
        return self._worker.error

    @property
    def stop_reason(self) -> str:
        """Why the engine does not run, in one line: what killed its thread, else "stopped"."""
        return "stopped" if self.error is None else one_line(self.error)

    async def start(self):
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._loop is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._set_stats(dict(self.engine.stats()))
        if self.prefix_caching is not None:
            self.metrics.prefix_cache_enabled.set(int(self.prefix_caching))
        self._worker.thread.start()

    async def submit(self, prompt_ids: list[int], params, request_id: str | None = None, *,
                     arrival_time: float | None = None) -> RequestStream:
        """`arrival_time`: when the request reached the server (perf_counter; default now), where
        its TTFT starts (an n-sample request's samples 1.. are submitted later). Raises as
        submit_all; a `request_id` of a request still open is refused (vLLM's)."""
        return (await self.submit_all([(prompt_ids, params)], arrival_time=arrival_time,
                                      request_ids=[request_id]))[0]

    async def submit_all(self, jobs: list[tuple[list[int], object]], *, arrival_time: float | None = None,
                         request_ids: list[str | None] | None = None) -> list[RequestStream]:
        """One user request of several engine requests (an OpenAI request's prompts x n), each job
        (prompt_ids, params): all admitted, or none. A queue without room for all of them refuses
        the lot (one QueueFullError, counted once; a ValueError for more than max_waiting); on any
        other error the admitted ones are aborted, none counts, and the first error is raised."""
        if not self.running:
            raise EngineDeadError(f"engine is not running ({self.stop_reason})")
        if len(jobs) > self.max_waiting:  # NOTE: a 429 here would refuse every retry as well
            raise ValueError(f"{len(jobs)} requests at once can never wait together for a first token "
                             f"(max_waiting={self.max_waiting})")
        if self.num_waiting + len(jobs) > self.max_waiting:
            self.metrics.rejected.inc()
            needs = f"; this request needs {len(jobs)}" if len(jobs) > 1 else ""
            raise QueueFullError(f"server busy: {self.num_waiting} requests already wait for a first token "
                                 f"(max_waiting={self.max_waiting}{needs}); retry later")
        names = self._new_request_ids(len(jobs), request_ids)
        states, admissions = [], []
        for (prompt_ids, params), rid in zip(jobs, names, strict=True):
            states.append(state := self._open(rid, len(prompt_ids), arrival_time))
            admissions.append(accepted := self._loop.create_future())
            self._pending.add(accepted)
            self._worker.post(("add", state.engine_id, list(prompt_ids), params, accepted))
        try:
            answers = await asyncio.gather(*admissions, return_exceptions=True)
        except BaseException:  # the caller was cancelled (gather cancelled the admissions)
            self._roll_back(states, admissions)
            raise
        if errors := [e for e in answers if e is not None]:  # refused (ValueError), engine gone
            self._roll_back(states, admissions)
            raise errors[0]
        self._pending.difference_update(admissions)
        for state in states:
            self._count_accepted(state)
        return [RequestStream(state) for state in states]

    def _new_request_ids(self, count: int, request_ids: list[str | None] | None) -> list[str]:
        """The ids of `count` new requests: those given (a str each, none of them open) or fresh ones."""
        given = [None] * count if request_ids is None else list(request_ids)
        if len(given) != count:
            raise ValueError(f"request_ids has {len(given)} ids for {count} requests")
        for rid in given:
            if rid is not None and not isinstance(rid, str):  # NOTE: ids key dicts, logs, JSON
                raise ValueError(f"request_id must be a str (or None: a fresh one), got {type(rid).__name__}")
        names = [rid or uuid.uuid4().hex for rid in given]
        for rid in names:
            if rid in self._streams or names.count(rid) > 1:
                raise ValueError(f"request_id {rid!r} is already in use")
        return names

    def abort(self, request_id: str, *, stopped: bool = False):
        """Drop an open request; its pages go back before the engine's next step. stopped=True: it
        ended normally (a stop string), so it counts as finished, not aborted."""
        if (state := self._streams.get(request_id)) is not None:
            state.close(stopped=stopped)

    def end_request(self, state: StreamState, *, stopped: bool):
        """A closed stream's request leaves the open ones (counted once) and the engine."""
        if self._end(state, aborted=not stopped):
            state.started.set()
            self._worker.post(("abort", state.engine_id))

    def abandon(self, state: StreamState):
        """Any thread (a RequestStream garbage-collected unclosed): its request is aborted on the
        event loop, as a client gone."""
        if self._loop is not None and not state.closed:
            try:
                self._loop.call_soon_threadsafe(state.close)
            except RuntimeError:  # the event loop is closed: nothing serves any more
                pass

    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def prefix_caching(self) -> bool | None:
        """Whether the engine shares KV pages of common prefixes (its scheduler's config,
        immutable); None when the engine does not say."""
        config = getattr(getattr(self.engine, "scheduler", None), "config", None)
        value = getattr(config, "enable_prefix_caching", None)
        return None if value is None else bool(value)

    def shutdown(self, timeout_s: float = 30.0):
        """Stop the engine thread (after its current step) and fail the open streams. The thread
        gone, their requests and the aborts it did not take leave the engine (their pages back)
        before a last snapshot of its stats, which so counts them."""
        check_seconds("timeout_s", timeout_s, zero_ok=True)
        stopped = self._worker.halt(timeout_s)
        if not stopped and self._worker.thread.is_alive():
            log.warning("engine thread did not stop within %g s", timeout_s)
        while self._worker.outbox:  # NOTE: outputs the thread made before it stopped reach their streams
            self._deliver_next()
        open_ids = [state.engine_id for state in self._streams.values()]
        self._fail_all(EngineDeadError("server shutting down"))
        if stopped and self.error is None:  # NOTE: the engine is this thread's now
            for engine_id in self._worker.take_aborts() + open_ids:
                self._worker.abort_quietly(engine_id)
            self._final_stats = True
            self._set_stats(dict(self.engine.stats()))

    def _open(self, request_id: str, prompt_len: int, arrival_time: float | None) -> StreamState:
        """A new submission's state, open (waiting for a first token) under `request_id`."""
        engine_id = engine_id_of(request_id, self._num_submitted)
        self._num_submitted += 1
        state = self._streams[request_id] = StreamState(self, request_id, engine_id, prompt_len, arrival_time)
        self._set_waiting(+1)
        return state

    def _roll_back(self, states: list[StreamState], admissions: list[asyncio.Future]):
        """A submission that raises leaves nothing: its requests still open leave the engine (an
        ended one left already) and count nothing (not accepted)."""
        self._pending.difference_update(admissions)
        for state in states:
            if self._end(state, aborted=True):
                self._worker.post(("abort", state.engine_id))  # a no-op where the engine refused it

    def _route(self, engine_id: str) -> StreamState | None:
        """The open submission an engine id names; None once it ended (an output of an aborted
        request, or of an ended one whose request_id names a new request by now)."""
        state = self._streams.get(request_id_of(engine_id))
        return state if state is not None and state.engine_id == engine_id else None

    def _end(self, state: StreamState, *, aborted: bool) -> bool:
        """The one place a request leaves the open streams (False if it already did): it waits
        for a first token no more, and its end counts once, as finished or aborted, when submit
        has returned it (at that return, if it ended before). A submit that fails or is
        cancelled returns nothing: that request counts neither as accepted nor ended."""
        if self._streams.get(state.request_id) is not state:
            return False
        del self._streams[state.request_id]
        if state.first_token_at is None:
            self._set_waiting(-1)
        state.mark_ended(aborted)
        self._count_end(state)
        return True

    def _count_accepted(self, state: StreamState):
        state.accepted = True
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(state.prompt_len)
        if state.ended_aborted is not None:  # it ended before its submitter resumed
            self._count_end(state)

    def _count_end(self, state: StreamState):
        """A finished request's latencies count with it: e2e's count is requests_finished_total."""
        if not state.accepted:
            return
        if state.ended_aborted:
            self.metrics.aborted.inc()
            return
        self.metrics.finished.inc()
        self.metrics.e2e.observe(state.e2e)
        if state.tpot is not None:
            self.metrics.tpot.observe(state.tpot)

    def _set_waiting(self, delta: int):
        self.num_waiting += delta
        self.metrics.waiting.set(self.num_waiting)

    def _deliver_next(self):
        """Event loop: the oldest step's outputs the thread made, if shutdown did not take them."""
        if self._worker.outbox:
            self._deliver(self._worker.outbox.popleft())

    def _deliver(self, outputs):
        """Event loop: route one step's outputs to their streams."""
        now = time.perf_counter()
        for out in outputs:
            state = self._route(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            out.request_id = state.request_id  # NOTE: the caller's id, not the submission's
            if state.record_output(out, now):
                self.metrics.ttft.observe(state.ttft)
                self._set_waiting(-1)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self._end(state, aborted=False)
            state.queue.put_nowait(out)

    def _accept(self, future, error):
        if future.done():  # the submitter was cancelled; submit() posts the abort
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _fail_all(self, error: BaseException):
        """Every open stream and every unanswered admission gets `error`; the streams count as aborted."""
        self._fail_streams(list(self._streams.values()), error)
        for future in self._pending:
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _fail_streams(self, states: list[StreamState], error: BaseException):
        """The streams of `states` still open end with `error` (counted aborted)."""
        for state in states:
            if self._end(state, aborted=True):
                state.queue.put_nowait(error)
                state.started.set()

    def _on_step_failure(self, engine_ids: list[str], error: RequestFailedError):
        self.metrics.step_failures.inc()
        self._fail_streams([state for e in engine_ids if (state := self._route(e)) is not None], error)

    def _on_death(self, error: EngineDeadError):
        """The engine thread died: every open request fails, and the engine's gauges stop
        reading as a live engine's (ServingMetrics.engine_died)."""
        self._fail_all(error)
        self._stats = self.metrics.engine_died(self._stats)  # stats() reads as /metrics does

    def _on_stats(self, stats):
        if not self._final_stats:  # NOTE: shutdown's snapshot is newer than any the thread posted
            self._set_stats(stats)

    def _set_stats(self, stats):
        self._stats = stats
        self.metrics.set_engine_stats(stats)
