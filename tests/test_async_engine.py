"""The AsyncEngine's contract (loopjax/async_engine.py) against an exact fake engine, in
process without HTTP: the bounded queue, refusals that queue nothing, aborts that free
pages, a dying engine, and shutdown while a step runs."""

from __future__ import annotations

import asyncio
import threading

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
