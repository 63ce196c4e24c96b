"""Background engine loop: one thread owns the Engine, asyncio callers submit and stream.

Contract:
- Every Engine call (add_request, abort, step, stats) runs in the engine thread, so the
  Engine needs no locks and all JAX work stays on one thread. The thread steps while the
  engine has work and sleeps on an event when idle.
- Callers on the event loop `await submit(prompt_ids, params)`: it returns a
  `RequestStream` once the engine accepted the request, raises ValueError (one line) for
  bad input and `QueueFullError` while `max_waiting` accepted requests still wait for their
  first token (the bounded queue: the server answers 429). Nothing is queued on error; any
  other error of add_request (a bug) fails that request alone with a RuntimeError (500).
- Outputs reach the event loop in one `loop.call_soon_threadsafe` per engine step and are
  fed to per-request asyncio queues. Closing a stream early (client gone) aborts its
  request: the engine thread frees its pages before its next step.
- Admission window (`admission_window_s`, off by default): when work arrives at an idle
  engine, the thread keeps taking requests while they arrive less than a window apart (at
  most ADMISSION_WINDOWS windows) before its first step, so that a burst's prompts can share
  the first prefill steps; a lone request pays one window. Over HTTP the first prompt of a
  burst prefills alone (the server handles requests one at a time); on the H200 host a 2 ms
  window changed nothing and 5 or 10 ms made burst-32 slower (bench/RESULTS.md runs 26, 30),
  so it stays off. A busy engine takes new requests at its next step.
- `stats()` is a snapshot the engine thread refreshes after every turn of its loop.
- Metrics: requests_total counts the requests submit returned; each ends counted once, in
  requests_finished_total or requests_aborted_total. A submit that raises counts in neither.
  Latencies run from the request's arrival (submit's arrival_time): TTFT counts at a first
  token, TPOT and e2e with a finished request (a stop string's too).
- A step that fails on the device (the Engine's StepFailedError) fails the requests it lost
  with a `RequestFailedError` (HTTP 500) and the loop serves on, when the engine made a fresh
  device state. After MAX_STEP_FAILURES failed steps with no token between them, one it could
  not recover from, or any other error of a step, the loop stops: every open request gets an
  `EngineDeadError` (503), as do every later submit and /health.
- `shutdown()` sets the stop event, joins the thread and fails the streams still open.
This module imports neither JAX nor FastAPI; it works with any object that has the
Engine's add_request / abort / step / has_unfinished / stats methods.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
import traceback
import uuid

from loopjax.metrics import ServingMetrics
from loopjax.request import StepFailedError
from loopjax.request_stream import CLOSED, RequestStream

log = logging.getLogger("loopjax.async_engine")


ADMISSION_WINDOWS = 10  # the longest an idle engine waits for a burst's requests, in windows
MAX_STEP_FAILURES = 3  # failed steps with no token between them, after which the device counts as dead


class QueueFullError(RuntimeError):
    """Too many requests wait for their first token; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or a step raised)."""


class RequestFailedError(RuntimeError):
    """A step failed on the device and lost this request; the engine serves on (HTTP 500)."""


def _check_seconds(name: str, value, *, zero_ok: bool) -> None:
    """A finite number of seconds, > 0 (>= 0 when `zero_ok`), or a one-line ValueError naming it."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0 (seconds), "
                         f"got {value!r}")


class AsyncEngine:
    def __init__(self, engine, *, max_waiting: int = 256, idle_timeout_s: float = 0.5,
                 admission_window_s: float = 0.0, metrics: ServingMetrics | None = None):
        # NOTE: max_waiting 0 would refuse every request with a 429 no retry passes; an idle
        # timeout <= 0 spins the idle thread; an infinite wait raises in the engine thread
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        _check_seconds("idle_timeout_s", idle_timeout_s, zero_ok=False)
        _check_seconds("admission_window_s", admission_window_s, zero_ok=True)
        self.engine = engine
        self.admission_window_s = admission_window_s
        self.max_waiting = max_waiting  # accepted requests without a first token (queue bound)
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics or ServingMetrics()
        self.num_waiting = 0  # event-loop side count of requests without a first token
        self._streams: dict[str, RequestStream] = {}  # event-loop side; open requests
        self._pending: set[asyncio.Future] = set()  # event-loop side; admissions not answered yet
        self._inbox: collections.deque = collections.deque()  # thread-safe appends/pops
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: dict = {}
        self.error: BaseException | None = None  # what killed the engine thread, if anything

    # ------------------------------------------------------------ event-loop side
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def start(self):
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._stats = dict(self.engine.stats())
        self.metrics.set_engine_stats(self._stats)
        if self.prefix_caching is not None:
            self.metrics.prefix_cache_enabled.set(int(self.prefix_caching))
        self._thread = threading.Thread(target=self._run, name="loopjax-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: list[int], params, request_id: str | None = None, *,
                     arrival_time: float | None = None) -> RequestStream:
        """`arrival_time`: when the request reached the server (perf_counter; default now), where
        its TTFT starts (an n-sample request's samples 1.. are submitted later)."""
        if not self.running:
            raise EngineDeadError(f"engine is not running ({self.error or 'stopped'})")
        if self.num_waiting >= self.max_waiting:
            self.metrics.rejected.inc()
            raise QueueFullError(f"server busy: {self.num_waiting} requests already wait for a "
                                 f"first token (max_waiting={self.max_waiting}); retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, len(prompt_ids), arrival_time)
        accepted = self._loop.create_future()
        self._pending.add(accepted)
        self._streams[request_id] = stream
        self._set_waiting(+1)
        self._post(("add", request_id, list(prompt_ids), params, accepted))
        try:
            await accepted
        except BaseException:  # refused (ValueError), engine gone, or the caller was cancelled
            self._pending.discard(accepted)
            # NOTE: a stream that ended meanwhile left the engine already, and its id may be
            # in use again: only a stream still open is rolled back (not accepted: counts nothing)
            if self._streams.get(request_id) is stream:
                self._end(request_id, aborted=True)
                self._post(("abort", request_id))  # no-op when the engine refused it
            raise
        self._pending.discard(accepted)
        stream.accepted = True
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        if stream.ended_aborted is not None:  # it ended before this task resumed
            self._count_end(stream)
        return stream

    def abort(self, request_id: str, *, stopped: bool = False):
        """Drop a request; its pages go back before the engine's next step. stopped=True: it
        ended normally (a stop string), so it counts as finished, not aborted."""
        stream = self._end(request_id, aborted=not stopped)
        if stream is None:
            return
        stream.closed = True
        stream.queue.put_nowait(CLOSED)
        stream.started.set()
        self._post(("abort", request_id))

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
        """Stop the engine thread (after its current step) and fail the open streams."""
        _check_seconds("timeout_s", timeout_s, zero_ok=True)
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %g s", timeout_s)
            elif self.error is None:  # the thread is gone: a last, fresh snapshot is safe here
                self._on_stats(dict(self.engine.stats()))
        self._fail_all(EngineDeadError("server shutting down"))

    def _end(self, request_id: str, *, aborted: bool) -> RequestStream | None:
        """The one place a request's stream leaves the open streams (None if it already did):
        it waits for a first token no more, and its end counts once, as finished or aborted,
        when submit has returned it (at that return, if it ended before). A submit that fails
        or is cancelled returns nothing: that request counts neither as accepted nor ended."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if stream.first_token_at is None:
                self._set_waiting(-1)
            stream.ended_aborted = aborted
            # NOTE: a stop string (abort with stopped=True) ends it normally too: its times count
            if not aborted:
                stream.e2e = time.perf_counter() - stream.submitted_at
                if stream.num_tokens > 1:
                    stream.tpot = (stream.last_output_at - stream.first_token_at) / (stream.num_tokens - 1)
            self._count_end(stream)
        return stream

    def _count_end(self, stream: RequestStream):
        """A finished request's latencies count with it: e2e's count is requests_finished_total."""
        if not stream.accepted:
            return
        if stream.ended_aborted:
            self.metrics.aborted.inc()
            return
        self.metrics.finished.inc()
        self.metrics.e2e.observe(stream.e2e)
        if stream.tpot is not None:
            self.metrics.tpot.observe(stream.tpot)

    def _set_waiting(self, delta: int):
        self.num_waiting += delta
        self.metrics.waiting.set(self.num_waiting)

    def _post(self, command):
        self._inbox.append(command)
        self._wake.set()

    def _deliver(self, outputs):
        """Event loop: route one step's outputs to their streams."""
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if stream.first_token_at is None and (out.new_token_ids or out.finished):
                stream.first_token_at = now
                stream.ttft = now - stream.submitted_at
                self.metrics.ttft.observe(stream.ttft)
                self._set_waiting(-1)
                stream.started.set()
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            stream.num_tokens, stream.last_output_at = len(out.token_ids), now
            if out.finished:
                stream.finished = True
                self._end(out.request_id, aborted=False)
            stream.queue.put_nowait(out)

    def _accept(self, future, error):
        if future.done():  # the submitter was cancelled; submit() posts the abort
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _fail_all(self, error: BaseException):
        """Every open stream and every unanswered admission gets `error`; the streams count as aborted."""
        self._fail_streams(list(self._streams), error)
        for future in self._pending:
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _fail_streams(self, request_ids: list[str], error: BaseException):
        """The streams of `request_ids` still open end with `error` (counted aborted)."""
        for request_id in request_ids:
            if (stream := self._end(request_id, aborted=True)) is not None:
                stream.queue.put_nowait(error)
                stream.started.set()

    def _on_step_failure(self, request_ids: list[str], error: RequestFailedError):
        self.metrics.step_failures.inc()
        self._fail_streams(request_ids, error)

    def _on_stats(self, stats):
        self._stats = stats
        self.metrics.set_engine_stats(stats)

    # ------------------------------------------------------------ engine thread
    def _call(self, fn, *args):
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed under us (shutdown)
            self._stop.set()

    def _run(self):
        failures = 0  # failed steps since the last token
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before draining: a post after this wakes the wait below
                idle = not self.engine.has_unfinished()
                changed = self._drain_inbox()
                if idle and changed:
                    self._admit_burst()
                if self.engine.has_unfinished():
                    try:
                        outputs = self.engine.step()
                        if any(out.new_token_ids for out in outputs):  # a token: the device works
                            failures = 0
                    except StepFailedError as e:
                        failures += 1
                        if not e.recovered or failures >= MAX_STEP_FAILURES:
                            raise
                        log.error("%s; the engine serves on", e)
                        self._call(self._on_step_failure, e.request_ids, RequestFailedError(str(e)))
                        outputs = None
                    if outputs:
                        self._call(self._deliver, outputs)
                    changed = True
                if changed:
                    self._call(self._on_stats, dict(self.engine.stats()))
                elif self._stop.is_set():
                    break
                else:
                    self._wake.wait(self.idle_timeout_s)
        # NOTE: BaseException too (a SystemExit, a KeyboardInterrupt raised inside a library): a
        # thread that ended without this left every open stream waiting for good
        except BaseException as e:  # a broken step: every open request gets this error
            log.error("engine loop died:\n%s", traceback.format_exc())
            self.error = e
            self._stop.set()
            self._call(self._fail_all, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))

    def _admit_burst(self):
        """Work reached an idle engine: take requests while they keep arriving less than a
        window apart, for at most ADMISSION_WINDOWS windows (module note)."""
        window = self.admission_window_s
        deadline = time.perf_counter() + ADMISSION_WINDOWS * window
        while window > 0 and not self._stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0 or not self._wake.wait(min(window, left)):
                return
            self._wake.clear()
            self._drain_inbox()

    def _drain_inbox(self) -> bool:
        changed = False
        while self._inbox:
            command = self._inbox.popleft()
            changed = True
            if command[0] == "add":
                _, request_id, prompt_ids, params, accepted = command
                try:
                    self.engine.add_request(prompt_ids, params, request_id=request_id)
                except ValueError as e:
                    self._call(self._accept, accepted, ValueError(str(e)))
                except Exception as e:  # NOTE: a bug in one request's checks must not kill the loop
                    log.error("add_request %s failed:\n%s", request_id, traceback.format_exc())
                    self._abort_quietly(request_id)  # nothing of it stays queued
                    self._call(self._accept, accepted,
                               RuntimeError(f"request not admitted: {type(e).__name__}: {e}"))
                else:
                    self._call(self._accept, accepted, None)
            else:  # ("abort", request_id): unknown or finished ids are fine
                self._abort_quietly(command[1])
        return changed

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception as e:  # NOTE: an abort must never kill the loop (unknown ids are fine)
            log.debug("abort %s: %s", request_id, e)
