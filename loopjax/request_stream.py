"""A request's stream of RequestOutputs on the event loop (AsyncEngine.submit's answer) and
`merge_streams`, which reads several of them as one (the server's choices). The AsyncEngine
(async_engine.py) feeds each stream's queue from the event loop; nothing here is thread-safe."""

from __future__ import annotations

import asyncio
import time

CLOSED = object()  # queue item: the stream was closed while a reader waited


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one.

    `close()` before the end aborts the request. Timing (perf_counter seconds): `ttft`
    from `submitted_at` (submit's arrival_time, else its call) to the first output carrying
    tokens, `tpot` mean time per token after it.
    `started` is set at that first output (the prompt is prefilled: its full pages are in
    the prefix cache, when on) or when the stream ends without one (aborted, failed).
    """

    def __init__(self, owner, request_id: str, prompt_len: int, submitted_at: float | None = None):
        self.owner, self.request_id, self.prompt_len = owner, request_id, prompt_len
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted_at = time.perf_counter() if submitted_at is None else submitted_at
        self.first_token_at: float | None = None
        self.ttft: float | None = None
        self.tpot: float | None = None
        self.e2e: float | None = None  # from submitted_at to its end, once finished (not aborted)
        self.num_tokens, self.last_output_at = 0, 0.0  # of the last output delivered
        self.started = asyncio.Event()
        self.finished = False  # the engine reported the request finished
        self.closed = False  # no more items will be read
        self.accepted = False  # submit returned it: counted in requests_total, its end counted once
        self.ended_aborted: bool | None = None  # set when it leaves the open streams

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        if item.finished:
            self.closed = True
        return item

    def close(self, *, stopped: bool = False):
        """Stop reading (a reader waiting now gets StopAsyncIteration); aborts the request if
        it has not ended (finished, failed). stopped=True: the reader ended it normally (a stop
        string matched): counted as finished, not as a client abort."""
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(CLOSED)
            # NOTE: an ended request's id may name a new request already: that one stays
            if self.ended_aborted is None:
                self.owner.abort(self.request_id, stopped=stopped)



async def merge_streams(streams: list[RequestStream]):
    """Yields (index, RequestOutput) of all streams as outputs arrive; re-raises a stream's
    error; closes every stream (aborting unfinished requests) when the consumer stops."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()
