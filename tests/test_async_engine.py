"""The AsyncEngine's contract (loopjax/async_engine.py) against an exact fake engine, in
process without HTTP: the bounded queue, refusals that queue nothing, aborts that free
pages, a dying engine, and shutdown while a step runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from loopjax.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from loopjax.sampling_params import SamplingParams


def test_async_engine_contract():
    async def main():
        fake = FakeEngine()
        fake.paused = True
        aeng = AsyncEngine(fake, max_waiting=3, idle_timeout_s=0.01)
        await aeng.start()
        params = SamplingParams(max_tokens=5, temperature=0)
        with pytest.raises(ValueError, match="empty"):  # refused, nothing queued
            await aeng.submit([], params)
        streams = [await aeng.submit([10 * i], params) for i in range(1, 4)]
        with pytest.raises(QueueFullError):  # three wait for a first token already
            await aeng.submit([1], params)
        assert aeng.num_waiting == 3 and len(fake.requests) == 3
        assert not any(s.started.is_set() for s in streams)  # no output yet
        fake.paused = False
        outs = [[o async for o in s] for s in streams[:2]]
        assert streams[0].started.is_set()
        assert [o[-1].token_ids for o in outs] == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
        assert streams[0].ttft > 0 and streams[0].tpot > 0
        long = await aeng.submit([0], SamplingParams(max_tokens=10_000, temperature=0))
        await long.__anext__()
        long.close()  # abort: the fake engine drops it, its page goes back
        assert (aeng.metrics.aborted.value, aeng.metrics.finished.value) == (1, 3)  # 3 ran to the end
        ended = await aeng.submit([0], SamplingParams(max_tokens=10_000, temperature=0))
        await ended.__anext__()
        ended.close(stopped=True)  # the server matched a stop string: finished, not a client abort
        assert (aeng.metrics.aborted.value, aeng.metrics.finished.value) == (1, 4)
        fake.paused = True
        queued = await aeng.submit([0], params)
        queued.close()  # aborted before any output: `started` still releases a waiter
        await asyncio.wait_for(queued.started.wait(), 1)
        assert queued.first_token_at is None
        fake.paused = False
        for _ in range(2000):  # generous: CI machines are shared
            if aeng.stats()["pages_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert aeng.stats()["pages_used"] == 0 and aeng.num_waiting == 0
        aeng.shutdown()
        assert not aeng.running and len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids

        dying = AsyncEngine(FakeEngine(fail_at_step=2))
        await dying.start()
        s = await dying.submit([1], SamplingParams(max_tokens=50, temperature=0))
        with pytest.raises(EngineDeadError, match="device fell over"):
            async for _ in s:
                pass
        with pytest.raises(EngineDeadError):
            await dying.submit([1], params)
        dying.shutdown()

        # Ctrl-C while a step runs: admissions still in the inbox are answered, never left hanging.
        slow = FakeEngine()
        slow.gate = threading.Event()
        stopping = AsyncEngine(slow)
        await stopping.start()
        first = await stopping.submit([1], params)  # accepted; the thread then blocks in step()
        for _ in range(1000):
            if slow.steps:
                break
            await asyncio.sleep(0.01)
        late = asyncio.ensure_future(stopping.submit([2], params))
        await asyncio.sleep(0.1)
        assert not late.done()
        stopping.shutdown(timeout_s=0.2)
        slow.gate.set()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await late
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in first:
                pass

    asyncio.run(asyncio.wait_for(main(), 60))


class _CountingEngine(FakeEngine):
    """FakeEngine that records how many requests each step saw."""

    def __init__(self):
        super().__init__()
        self.rows_per_step = []

    def step(self):
        self.rows_per_step.append(len(self.requests))
        return super().step()


def test_idle_engine_admits_a_burst_before_its_first_step():
    """Requests reaching an idle engine a few ms apart (the server parses them one by one) share
    its first step when they arrive within the admission window of each other; with the window
    off the first one steps alone. A lone request waits one window, not the longest wait."""
    params = SamplingParams(max_tokens=3, temperature=0)

    async def first_step_rows(window_s: float, gap_s: float, count: int) -> tuple[int, float]:
        fake = _CountingEngine()
        aeng = AsyncEngine(fake, admission_window_s=window_s, idle_timeout_s=0.01)
        await aeng.start()
        start = asyncio.get_running_loop().time()
        streams = []
        for i in range(count):
            streams.append(await aeng.submit([i + 1], params))
            await asyncio.sleep(gap_s)
        first = await streams[0].__anext__()
        waited = asyncio.get_running_loop().time() - start
        for s in streams:
            async for _ in s:
                pass
        aeng.shutdown()
        assert first.token_ids == [2]
        return fake.rows_per_step[0], waited

    async def main():
        rows, _ = await first_step_rows(0.05, 0.003, 6)  # gaps well inside the window
        assert rows == 6
        rows, _ = await first_step_rows(0.0, 0.005, 6)  # off: the first request steps alone
        assert rows < 6
        _, waited = await first_step_rows(0.05, 0.0, 1)  # one window, not ADMISSION_WINDOWS
        assert 0.04 < waited < 0.3

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("option, value", [
    ("admission_window_s", -1), ("admission_window_s", float("nan")), ("admission_window_s", float("inf")),
    ("idle_timeout_s", 0), ("idle_timeout_s", -0.5), ("idle_timeout_s", float("nan")),
    ("idle_timeout_s", float("inf")), ("idle_timeout_s", 1e10), ("idle_timeout_s", "1"), ("max_waiting", 0),
    ("max_waiting", 2.5), ("max_waiting", float("nan")), ("max_waiting", True)])
def test_numeric_options_are_checked(option, value):
    """Each option is refused in one line naming it (an idle timeout <= 0 spun the idle thread, a
    NaN or too long one or an infinite admission window killed the engine thread at its first
    wait, a NaN max_waiting passed its check)."""
    with pytest.raises(ValueError, match=rf"^{option} must be an? (finite number|integer) >=? ?[01]") as e:
        AsyncEngine(FakeEngine(), **{option: value})
    assert "\n" not in str(e.value) and repr(value) in str(e.value)


class _BuggyAddEngine(FakeEngine):
    """FakeEngine whose add_request registers prompt [666] and then fails with a TypeError
    (a bug in a request's checks, not a refusal)."""

    def add_request(self, prompt_ids, params, request_id=None):
        super().add_request(prompt_ids, params, request_id)
        if prompt_ids == [666]:
            raise TypeError("unexpected")
        return request_id


def test_an_unexpected_add_request_error_fails_that_request_only():
    """The request gets the error (the server answers 500), nothing of it stays queued, and
    the loop keeps serving the next requests."""
    params = SamplingParams(max_tokens=3, temperature=0)

    async def main():
        fake = _BuggyAddEngine()
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        with pytest.raises(RuntimeError, match="request not admitted: TypeError: unexpected"):
            await aeng.submit([666], params)
        assert not fake.requests and aeng.running
        outs = [o async for o in await aeng.submit([1], params)]
        assert outs[-1].token_ids == [2, 3, 4]
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_submit_cancelled_after_its_first_token_counts_it_once():
    """The engine thread posts a request's admission and its first output back to back; a
    submitter cancelled between them (uvicorn's shutdown cancels handlers) rolls the request
    back: it waited for a first token no more, so the waiting count drops once (it dropped
    twice, to -1, loosening max_waiting for good) and its page goes back."""
    import types

    params = SamplingParams(max_tokens=50, temperature=0)

    async def main():
        fake = FakeEngine()
        fake.paused = True  # no step: the first output below is the test's
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        accept, task = aeng._accept, None

        def accept_then_output_then_cancel(future, error):
            accept(future, error)  # the submitter's wake-up is queued ...
            rid = next(iter(aeng._streams.values())).engine_id
            aeng._deliver([types.SimpleNamespace(request_id=rid, new_token_ids=[2], token_ids=[2],
                                                 finished=False)])  # ... its first token comes first
            task.cancel()

        aeng._accept = accept_then_output_then_cancel
        task = asyncio.ensure_future(aeng.submit([1], params))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert aeng.num_waiting == 0 and aeng.metrics.waiting.value == 0
        for _ in range(500):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert not fake.requests  # the abort reached the engine
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_step_lost_on_the_device_fails_its_requests_and_the_engine_serves_on():
    """The Engine's StepFailedError (a failed read, a fresh device state made): the requests it
    lost end with a RequestFailedError naming the failure, the loop serves on; MAX_STEP_FAILURES
    failed steps with no token between them (the steps that only report the aborts give none)
    make the device count as dead, as does a failure without a fresh state."""
    from loopjax.async_engine import MAX_STEP_FAILURES, RequestFailedError

    params = SamplingParams(max_tokens=4, temperature=0)

    async def run(stream):
        return [o.token_ids async for o in stream][-1]

    async def start(fake):
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        return aeng

    async def main():
        fake = FakeEngine(lose_token=lambda t: t == 12)
        fake.paused = True  # both admitted before the first step
        aeng = await start(fake)
        streams = [await aeng.submit([10 * i], params) for i in (1, 2)]
        fake.paused = False
        for stream in streams:  # 11 and 21, then the step that would give 12 loses both
            with pytest.raises(RequestFailedError, match=r"^a step failed on the device; 2 lost$"):
                await run(stream)
        assert await run(await aeng.submit([5], params)) == [6, 7, 8, 9]
        assert aeng.running and aeng.num_waiting == 0
        assert (aeng.metrics.step_failures.value, aeng.metrics.aborted.value) == (1, 2)
        aeng.shutdown()

        # a token before each failure: it serves on, however many fail
        aeng = await start(FakeEngine(lose_token=lambda t: t == 3))
        for _ in range(MAX_STEP_FAILURES + 1):
            with pytest.raises(RequestFailedError):
                await run(await aeng.submit([1], params))
        assert aeng.running and aeng.metrics.step_failures.value == MAX_STEP_FAILURES + 1
        aeng.shutdown()

        aeng = await start(FakeEngine(lose_token=lambda t: True))  # a broken device: no token at all
        for _ in range(1, MAX_STEP_FAILURES):
            with pytest.raises(RequestFailedError):
                await run(await aeng.submit([1], params))
        with pytest.raises(EngineDeadError, match=r"^engine step failed: StepFailedError: a step failed"):
            await run(await aeng.submit([1], params))
        assert not aeng.running and aeng.metrics.step_failures.value == MAX_STEP_FAILURES - 1
        with pytest.raises(EngineDeadError):
            await aeng.submit([1], params)

        fake = FakeEngine(lose_token=lambda t: True)
        fake.recovered = False  # no fresh device state: dead at once
        aeng = await start(fake)
        with pytest.raises(EngineDeadError, match=r"^engine step failed: StepFailedError: a step failed"):
            await run(await aeng.submit([1], params))
        assert not aeng.running

    asyncio.run(asyncio.wait_for(main(), 60))


def test_each_accepted_request_counts_one_end_and_a_rolled_back_one_none():
    """requests_total counts the requests submit returned; each of those ends counted once, as
    finished or aborted, also when it ended before its submitter resumed. A submit that fails
    (shutdown while its admission waits) or is cancelled counts nothing (both counted an abort,
    or a finish, of a request never counted as accepted), and a cancelled one whose request
    ended meanwhile leaves alone a new request under its id (the rollback closed it)."""
    import types

    params = SamplingParams(max_tokens=50, temperature=0)

    def counts(aeng):
        m = aeng.metrics
        return m.requests.value, m.finished.value, m.aborted.value

    async def main():
        fake = FakeEngine()
        fake.paused = True  # no step: the outputs below are the test's
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        accept, task = aeng._accept, None

        def accept_then_finish(future, error, cancel):
            accept(future, error)  # the submitter's wake-up is queued; its last output comes first
            rid = next(iter(aeng._streams.values())).engine_id
            aeng._deliver([types.SimpleNamespace(request_id=rid, new_token_ids=[2], token_ids=[2],
                                                 finished=True)])
            if cancel:
                task.cancel()

        aeng._accept = lambda future, error: accept_then_finish(future, error, cancel=False)
        stream = await aeng.submit([1], params)
        assert [o.token_ids async for o in stream] == [[2]] and counts(aeng) == (1, 1, 0)
        aeng._accept = lambda future, error: accept_then_finish(future, error, cancel=True)
        task = asyncio.ensure_future(aeng.submit([1], params))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert counts(aeng) == (1, 1, 0)
        # Its id, used again before the cancelled submitter resumes, stays with the new request
        # (the rollback closed the new stream and aborted the new request).
        loop = asyncio.get_running_loop()

        def finish_then_reuse_the_id(future, error):
            accept_then_finish(future, error, cancel=True)
            aeng._accept = accept
            reuse.append(asyncio.eager_task_factory(loop, aeng.submit([7], params, request_id="x")))

        reuse, aeng._accept = [], finish_then_reuse_the_id
        task = asyncio.ensure_future(aeng.submit([1], params, request_id="x"))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert set(aeng._streams) == {"x"} and aeng.num_waiting == 1
        fake.paused = False  # the new request runs to its end (an abort would leave it waiting)
        assert [o.token_ids async for o in await reuse[0]][-1][:2] == [8, 9]
        fake.paused = True
        fake.paused = False
        fake.gate = threading.Event()  # the next step waits: the admission after it stays unanswered
        running = await aeng.submit([1], params)
        while not fake.steps:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(aeng.submit([2], params))
        await asyncio.sleep(0)  # it posts its admission
        aeng.shutdown(timeout_s=0.01)
        fake.gate.set()
        for pending in (waiting, running.__anext__()):
            with pytest.raises(EngineDeadError, match="shutting down"):
                await pending
        assert counts(aeng) == (3, 2, 1) and aeng.num_waiting == 0
        assert aeng.metrics.e2e.count == 2  # the finished requests', not the rolled-back one's

    asyncio.run(asyncio.wait_for(main(), 60))


class _ExitingEngine(FakeEngine):
    """FakeEngine whose first step raises SystemExit (no Exception): a library that exits; or,
    given an `error`, raises that."""

    def __init__(self, error: BaseException | None = None):
        super().__init__()
        self.error = error or SystemExit("the step called sys.exit")

    def step(self):
        raise self.error


def test_an_engine_thread_ended_by_a_base_exception_fails_the_open_streams():
    """The thread's death is reported however the step raised: the open stream and later submits
    get an EngineDeadError naming it (a SystemExit ended the thread silently: the stream waited
    for good) and the engine counts as not running (/health 503)."""
    params = SamplingParams(max_tokens=3, temperature=0)

    async def main():
        aeng = AsyncEngine(_ExitingEngine(), idle_timeout_s=0.01)
        await aeng.start()
        stream = await aeng.submit([1], params)
        with pytest.raises(EngineDeadError, match="^engine step failed: SystemExit: the step called"):
            await stream.__anext__()
        assert not aeng.running and isinstance(aeng.error, SystemExit) and aeng.num_waiting == 0
        with pytest.raises(EngineDeadError, match="sys.exit"):
            await aeng.submit([1], params)
        aeng.shutdown()

        # An XLA error's many lines: each report of it is its first line (the stream's, a later
        # submit's, /health's stop_reason), not the whole dump.
        aeng = AsyncEngine(_ExitingEngine(RuntimeError("INTERNAL: device lost\n  at frame 1\n")),
                           idle_timeout_s=0.01)
        await aeng.start()
        stream = await aeng.submit([1], params)
        reason = "RuntimeError: INTERNAL: device lost"
        with pytest.raises(EngineDeadError, match=f"^engine step failed: {reason}$"):
            await stream.__anext__()
        with pytest.raises(EngineDeadError, match=rf"^engine is not running \({reason}\)$"):
            await aeng.submit([1], params)
        assert aeng.stop_reason == reason
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_request_ended_by_its_stop_string_counts_its_tpot():
    """A stop string ends a request normally (the server closes its stream as stopped): it counts
    as finished and, as a request the engine finished, in the TPOT histogram (it was left out:
    over HTTP every stop-string answer was); a client abort counts in neither."""
    params = SamplingParams(max_tokens=10_000, temperature=0)

    async def main():
        aeng = AsyncEngine(FakeEngine(), idle_timeout_s=0.01)
        await aeng.start()
        stopped, aborted = await aeng.submit([1], params), await aeng.submit([100], params)
        for stream, first in ((stopped, 1), (aborted, 100)):
            outs = [await stream.__anext__() for _ in range(3)]
            assert outs[-1].token_ids == [first + 1, first + 2, first + 3]
        stopped.close(stopped=True)
        aborted.close()
        m = aeng.metrics
        assert (m.finished.value, m.aborted.value, m.tpot.count, m.e2e.count) == (1, 1, 1, 1)
        assert stopped.tpot > 0 and aborted.tpot is None and m.tpot.sum == stopped.tpot
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_closing_a_failed_stream_leaves_a_new_request_under_its_id_alone():
    """A stream whose request failed (its error not read) and is closed afterwards aborts
    nothing: its id may name a new request by then (closing it aborted that one)."""
    from loopjax.async_engine import RequestFailedError

    params = SamplingParams(max_tokens=3, temperature=0)

    async def main():
        fake = FakeEngine()
        fake.paused = True
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        failed = await aeng.submit([1], params, request_id="y")
        aeng._on_step_failure([failed.engine_id], RequestFailedError("lost"))  # as the loop reports it
        again = await aeng.submit([10], params, request_id="y")
        failed.close()
        fake.paused = False
        assert [o.token_ids async for o in again][-1] == [11, 12, 13]
        m = aeng.metrics
        assert (m.requests.value, m.finished.value, m.aborted.value) == (2, 1, 1)
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_stream_its_reader_leaves_aborts_its_request():
    """A reader cancelled while it awaits an output, a stream closed with aclose() and one dropped
    unclosed each abort their request, as vLLM's AsyncLLM does (each ran on to its max_tokens,
    holding its page)."""
    long = SamplingParams(max_tokens=10_000, temperature=0)

    async def read_all(stream):
        async for _ in stream:
            pass

    async def main():
        fake = FakeEngine()
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        cancelled, closed = await aeng.submit([1], long), await aeng.submit([2], long)
        await aeng.submit([3], long)  # dropped at once
        reader = asyncio.ensure_future(read_all(cancelled))
        await asyncio.sleep(0)  # the reader runs until it awaits an output
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await closed.aclose()
        for _ in range(1000):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert not fake.requests and aeng.metrics.aborted.value == 3 and not aeng._streams
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_reused_request_id_gets_only_its_own_outputs():
    """Outputs are routed per submission: an id used again right after its request failed on
    the device gets none of the old request's outputs (the engine reports the lost request's
    abort with its next step: it ended the new request at once). An id still open is refused, as
    is one that is not a str (the engine refused it; its per-submission id is a str)."""
    from loopjax.async_engine import RequestFailedError

    params = SamplingParams(max_tokens=3, temperature=0)

    async def main():
        fake = FakeEngine()
        fake.paused = True
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        failed = await aeng.submit([1], params, request_id="y")
        with pytest.raises(ValueError, match="^request_id 'y' is already in use$"):
            await aeng.submit([5], params, request_id="y")
        with pytest.raises(ValueError, match="^request_id must be a str .* got int$"):
            await aeng.submit([5], params, request_id=7)
        fake.lost.append(fake.requests.popitem()[0])  # as a failed step: its abort comes next step
        aeng._on_step_failure([failed.engine_id], RequestFailedError("lost"))
        again = await aeng.submit([10], params, request_id="y")
        fake.paused = False
        outs = [o async for o in again]
        assert [o.token_ids for o in outs] == [[11], [11, 12], [11, 12, 13]] and outs[-1].request_id == "y"
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_engine_gauges_after_death_and_shutdown_read_what_is_true():
    """A dead engine's gauges read 0 (they kept its last live snapshot: a running request, a used
    page); shutdown fails the open streams and aborts their requests (and an abort the thread did
    not take) before its last snapshot, so nothing reads as running or holding pages (it took the
    snapshot first), and no older snapshot of the thread overwrites it."""
    from loopjax.metrics import parse

    long = SamplingParams(max_tokens=10_000, temperature=0)

    def gauges(aeng):
        samples = parse(aeng.metrics.render())
        return {k: samples[f"loopjax_{k}"] for k in ("running_rows", "pages_used", "waiting_requests")}

    async def main():
        aeng = AsyncEngine(FakeEngine(fail_at_step=3), idle_timeout_s=0.01)
        await aeng.start()
        stream = await aeng.submit([1], long)
        with pytest.raises(EngineDeadError):
            await read_all(stream)
        assert gauges(aeng) == {"running_rows": 0, "pages_used": 0, "waiting_requests": 0}
        assert parse(aeng.metrics.render())["loopjax_pages_free"] == 0
        assert aeng.stats()["pages_used"] == aeng.stats()["running_rows"] == 0  # as /metrics reads
        aeng.shutdown()

        fake = FakeEngine()
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        streams = [await aeng.submit([i], long) for i in (1, 2, 3)]
        for stream in streams:
            await stream.__anext__()
        streams[2].close()  # its abort may still be in the inbox when the thread stops
        aeng.shutdown()
        await asyncio.sleep(0.05)  # the thread's last posted snapshot (if any) runs now
        assert gauges(aeng) == {"running_rows": 0, "pages_used": 0, "waiting_requests": 0}
        assert aeng.stats()["pages_free"] == 100 and not fake.requests
        assert aeng.metrics.aborted.value == 3

    async def read_all(stream):
        async for _ in stream:
            pass

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_group_is_admitted_whole_or_refused_once():
    """submit_all (an OpenAI request's prompts x n): a queue without room for all of them
    refuses the group once (requests_rejected_total counted each refused member and admitted
    the others, to abort them), leaving nothing queued; a group that fits is admitted."""
    params = SamplingParams(max_tokens=2, temperature=0)

    async def main():
        fake = FakeEngine()
        fake.paused = True
        aeng = AsyncEngine(fake, max_waiting=3, idle_timeout_s=0.01)
        await aeng.start()
        first = await aeng.submit([1], params)  # held: a dropped stream aborts its request
        with pytest.raises(QueueFullError, match=r"max_waiting=3; this request needs 3\); retry later$"):
            await aeng.submit_all([([2], params)] * 3)
        with pytest.raises(ValueError, match=r"^4 requests at once can never wait .* \(max_waiting=3\)$"):
            await aeng.submit_all([([2], params)] * 4)  # no retry passes: not a QueueFullError
        m = aeng.metrics
        assert (m.rejected.value, m.requests.value, m.aborted.value, aeng.num_waiting) == (1, 1, 0, 1)
        group = await aeng.submit_all([([2], params), ([3], params)])
        assert len(fake.requests) == 3 and m.requests.value == 3
        fake.paused = False
        assert [[o.token_ids async for o in s][-1] for s in [first, *group]] == [[2, 3], [3, 4], [4, 5]]
        with pytest.raises(ValueError, match="empty"):  # one member refused: none stays, none counts
            await aeng.submit_all([([4], params), ([], params)])
        assert (m.requests.value, m.aborted.value, m.finished.value, aeng.num_waiting) == (3, 0, 3, 0)
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_shutdown_delivers_the_outputs_the_thread_made_before_it_stopped():
    """Outputs of the thread's last steps still on their way to the event loop when shutdown
    runs reach their streams (the streams failed with 'shutting down': a finished answer lost)."""
    params = SamplingParams(max_tokens=2, temperature=0)

    async def main():
        fake = FakeEngine()
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        stream = await aeng.submit([1], params)
        deadline = time.monotonic() + 10
        while fake.requests:  # NOTE: blocks the event loop: the thread's outputs wait on it
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.005)
        aeng.shutdown()
        assert [o.token_ids async for o in stream] == [[2], [2, 3]]
        assert aeng.metrics.finished.value == 1 and aeng.metrics.aborted.value == 0

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_end_without_tokens_is_no_first_token():
    """An output the engine finishes with no tokens counts as finished, takes no TTFT sample
    (vLLM's: TTFT is the first token's) and releases `started` and the waiting gauge."""
    import types

    async def main():
        fake = FakeEngine()
        fake.paused = True  # no step: the output below is the test's
        aeng = AsyncEngine(fake, idle_timeout_s=0.01)
        await aeng.start()
        stream = await aeng.submit([1], SamplingParams(max_tokens=5, temperature=0))
        rid = next(iter(aeng._streams.values())).engine_id
        aeng._deliver([types.SimpleNamespace(request_id=rid, new_token_ids=[], token_ids=[], finished=True)])
        assert [o.token_ids async for o in stream] == [[]] and stream.started.is_set()
        m = aeng.metrics
        assert (m.ttft.count, m.finished.value, m.e2e.count, aeng.num_waiting) == (0, 1, 1, 0)
        aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
