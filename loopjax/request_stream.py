"""A request's stream of RequestOutputs on the event loop (AsyncEngine.submit's answer) and
`merge_streams`, which reads several of them as one (the server's choices). The AsyncEngine
(async_engine.py) keeps each submission's `StreamState` and feeds its queue from the event loop;
the caller holds a `RequestStream` over it, so that a stream the caller drops is collected (and
its request aborted) while the engine still routes outputs to the state. Nothing here is
thread-safe but the collected stream's note to its owner (`AsyncEngine.abandon`)."""

from __future__ import annotations

import asyncio
import time
import weakref

CLOSED = object()  # queue item: the stream was closed while a reader waited
_SUBMISSION = "#"  # an engine id is request_id#k, k the number of the submission


def engine_id_of(request_id: str, number: int) -> str:
    return f"{request_id}{_SUBMISSION}{number}"


def request_id_of(engine_id: str) -> str:
    return engine_id.rpartition(_SUBMISSION)[0]


class StreamState:
    """One submission on the event loop: its queue, timing (perf_counter seconds) and end.

    `engine_id` names it in the engine (unique per submission: outputs and aborts of an
    ended request never reach a new one under the same `request_id`). `ttft` runs from
    `submitted_at` (submit's arrival_time, else its call) to the first output carrying tokens,
    `tpot` is the mean time per token after it. `started` is set at that first output (the
    prompt is prefilled: its full pages are in the prefix cache, when on) or when the request
    ends without one (aborted, failed)."""

    def __init__(self, owner, request_id: str, engine_id: str, prompt_len: int,
                 submitted_at: float | None = None):
        self.owner, self.request_id, self.engine_id = owner, request_id, engine_id
        self.prompt_len = prompt_len
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

    def record_output(self, out, now: float) -> bool:
        """Note an output delivered at `now`; True when it carries the first tokens. An end
        without tokens sets `started` but is no first token (vLLM's: no TTFT sample)."""
        first = self.first_token_at is None and bool(out.new_token_ids)
        if first:
            self.first_token_at, self.ttft = now, now - self.submitted_at
        if first or out.finished:
            self.started.set()
        self.num_tokens, self.last_output_at = len(out.token_ids), now
        self.finished = self.finished or out.finished
        return first

    def mark_ended(self, aborted: bool):
        """It left the open requests; a normal end (a stop string's too) times e2e and TPOT."""
        self.ended_aborted = aborted
        if not aborted:
            self.e2e = time.perf_counter() - self.submitted_at
            if self.num_tokens > 1:
                self.tpot = (self.last_output_at - self.first_token_at) / (self.num_tokens - 1)

    async def next(self):
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
        """Stop reading (a reader waiting now gets StopAsyncIteration); aborts the request if it
        has not ended (finished, failed); stopped=True counts it finished (RequestStream.close)."""
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(CLOSED)
            if self.ended_aborted is None:
                self.owner.end_request(self, stopped=stopped)


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one.

    `close()` (or `aclose()`) before the end aborts the request. So does a reader cancelled
    while it awaits an output, and a stream dropped unclosed once it is garbage-collected, as
    vLLM's AsyncLLM aborts a request whose generator is cancelled or closed: an abandoned
    request frees its pages rather than running to its max_tokens. The request's fields
    (`request_id`, `started`, `ttft`, `tpot`, `e2e`, `first_token_at`, `finished`, ...: see
    StreamState) read through to its state."""

    def __init__(self, state: StreamState):
        self._state = state
        finalizer = weakref.finalize(self, state.owner.abandon, state)
        finalizer.atexit = False  # NOTE: at exit the event loop is gone: nothing to abort

    def __getattr__(self, name):  # NOTE: only names the stream lacks reach here: the state's fields
        if name == "_state":
            raise AttributeError(name)
        return getattr(self._state, name)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._state.next()
        except asyncio.CancelledError:  # the reader is gone: its request must not run on
            self.close()
            raise

    def close(self, *, stopped: bool = False):
        """Stop reading (a reader waiting now gets StopAsyncIteration); aborts the request if
        it has not ended (finished, failed). stopped=True: the reader ended it normally (a stop
        string matched): counted as finished, not as a client abort."""
        self._state.close(stopped=stopped)

    async def aclose(self):
        """close(), as an async generator's: `contextlib.aclosing(stream)` works."""
        self.close()


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
