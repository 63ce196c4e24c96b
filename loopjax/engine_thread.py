"""The AsyncEngine's engine thread (async_engine.py): the one thread that calls the Engine.

Contract:
- It takes the event loop's commands from an inbox, in order: ("add", engine_id, prompt_ids,
  params, future) and ("abort", engine_id) (unknown or finished ids are fine). It steps while
  the engine has work and sleeps on an event when idle; `stop` ends it after its current step.
- It answers on the owner's event loop, in order, one `call_soon_threadsafe` each: an
  admission (`owner._accept(future, error)`: add_request's ValueError, with the caller's id
  for the engine id, or a RuntimeError line for any other error, a bug), a step's outputs
  (put in `outbox`, taken by `owner._deliver_next`), a step lost on the device
  (`owner._on_step_failure(engine_ids, RequestFailedError)`), a stats snapshot after every
  turn that changed something (`owner._on_stats`) and its death (`owner._on_death`).
- Admission window (`admission_window_s`, off by default): when work arrives at an idle
  engine, the thread keeps taking requests while they arrive less than a window apart (at
  most ADMISSION_WINDOWS windows) before its first step, so that a burst's prompts can share
  the first prefill steps; a lone request pays one window. Over HTTP the first prompt of a
  burst prefills alone (the server handles requests one at a time); on the H200 host a 2 ms
  window changed nothing and 5 or 10 ms made burst-32 slower (bench/RESULTS.md runs 26, 30),
  so it stays off. A busy engine takes new requests at its next step.
- A step that fails on the device (the Engine's StepFailedError) with a fresh device state
  made fails only the requests it lost; after MAX_STEP_FAILURES failed steps with no token
  between them, one it could not recover from, or any other error of a step (BaseException
  too), the thread stops with `error` set.
Like async_engine.py, it imports neither JAX nor FastAPI.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback

from loopjax.request import StepFailedError
from loopjax.request_stream import request_id_of

log = logging.getLogger("loopjax.async_engine")

ADMISSION_WINDOWS = 10  # the longest an idle engine waits for a burst's requests, in windows
MAX_STEP_FAILURES = 3  # failed steps with no token between them, after which the device counts as dead


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or a step raised)."""


class RequestFailedError(RuntimeError):
    """A step failed on the device and lost this request; the engine serves on (HTTP 500)."""


def one_line(error: BaseException) -> str:
    """`Type: the message's first line`: an error as one line (XLA's run over many)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class EngineThread:
    def __init__(self, owner, engine, *, idle_timeout_s: float, admission_window_s: float):
        self.owner, self.engine = owner, engine
        self.idle_timeout_s, self.admission_window_s = idle_timeout_s, admission_window_s
        self.inbox: collections.deque = collections.deque()  # thread-safe appends/pops
        self.outbox: collections.deque = collections.deque()  # steps' outputs, one owner._deliver_next each
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None  # what killed the thread, if anything
        self.thread = threading.Thread(target=self._run, name="loopjax-engine", daemon=True)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self.stop.is_set()

    def post(self, command):
        self.inbox.append(command)
        self.wake.set()

    def halt(self, timeout_s: float) -> bool:
        """Stop after the current step; whether the thread ended within `timeout_s`."""
        self.stop.set()
        self.wake.set()
        if self.thread.ident is None or self.thread is threading.current_thread():
            return False
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def take_aborts(self) -> list[str]:
        """The thread gone: the engine ids of the aborts it did not take; the inbox is emptied
        (its admissions' submitters were answered: those requests never entered the engine)."""
        aborts = [command[1] for command in self.inbox if command[0] == "abort"]
        self.inbox.clear()
        return aborts

    def _call(self, fn, *args):
        try:
            self.owner._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed under us (shutdown)
            self.stop.set()

    def _run(self):
        failures = 0  # failed steps since the last token
        try:
            while not self.stop.is_set():
                self.wake.clear()  # before draining: a post after this wakes the wait below
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
                        self._call(self.owner._on_step_failure, e.request_ids, RequestFailedError(str(e)))
                        outputs = None
                    if outputs:  # NOTE: through the outbox, so that shutdown delivers what is left
                        self.outbox.append(outputs)
                        self._call(self.owner._deliver_next)
                    changed = True
                if changed:
                    self._call(self.owner._on_stats, dict(self.engine.stats()))
                elif self.stop.is_set():
                    break
                else:
                    self.wake.wait(self.idle_timeout_s)
        # NOTE: BaseException too (a SystemExit, a KeyboardInterrupt raised inside a library): a
        # thread that ended without this left every open stream waiting for good
        except BaseException as e:  # a broken step: every open request gets this error
            log.error("engine loop died:\n%s", traceback.format_exc())
            self.error = e
            self.stop.set()
            self._call(self.owner._on_death, EngineDeadError(f"engine step failed: {one_line(e)}"))

    def _admit_burst(self):
        """Work reached an idle engine: take requests while they keep arriving less than a
        window apart, for at most ADMISSION_WINDOWS windows (module note)."""
        window = self.admission_window_s
        deadline = time.perf_counter() + ADMISSION_WINDOWS * window
        while window > 0 and not self.stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0 or not self.wake.wait(min(window, left)):
                return
            self.wake.clear()
            self._drain_inbox()

    def _drain_inbox(self) -> bool:
        changed = False
        while self.inbox:
            command = self.inbox.popleft()
            changed = True
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self.abort_quietly(command[1])
        return changed

    def _add(self, engine_id: str, prompt_ids: list[int], params, accepted):
        try:
            self.engine.add_request(prompt_ids, params, request_id=engine_id)
        except ValueError as e:  # NOTE: the engine's line names the caller's id
            line = str(e).replace(engine_id, request_id_of(engine_id))
            self._call(self.owner._accept, accepted, ValueError(line))
        except Exception as e:  # NOTE: a bug in one request's checks must not kill the loop
            log.error("add_request %s failed:\n%s", engine_id, traceback.format_exc())
            self.abort_quietly(engine_id)  # nothing of it stays queued
            self._call(self.owner._accept, accepted, RuntimeError(f"request not admitted: {one_line(e)}"))
        else:
            self._call(self.owner._accept, accepted, None)

    def abort_quietly(self, engine_id: str) -> None:
        try:
            self.engine.abort(engine_id)
        except Exception as e:  # NOTE: an abort must never kill the loop (unknown ids are fine)
            log.debug("abort %s: %s", engine_id, e)
