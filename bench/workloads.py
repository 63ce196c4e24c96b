"""The design note's serving workloads, driven against any `Backend`.

A Backend has one coroutine, `generate(prompt_ids, max_tokens) -> Record`, that streams one
request and times it: `InProcessBackend` (AsyncEngine over Engine, timed where outputs reach
the event loop) and `HttpBackend` (a server's SSE stream, timed at the client). A request
cancelled midway (a run cut by --max-seconds) leaves its record, with the tokens it received,
in the backend's `cut` list. Workloads only decide what to send and when:

- burst: C requests at once, random-token prompts of P tokens, O output tokens each.
- sessions: N sessions run concurrently, T turns each, one turn at a time per session;
  turn t's prompt is turn t-1's prompt + its answer + a new user message of U tokens
  (the first turn: a P-token opening), O output tokens per turn.

Prompts are uniform random token ids in [token_low, vocab_size) from `random.Random(seed)`,
so a (workload, sizes, seed) triple always sends the same prompts. Every request runs with
ignore_eos, so each one generates exactly O tokens, and with the backend's `sampling`
(SamplingParams keywords, the same fields over HTTP; {} is greedy). With `sampling_seed` a
request draws with the seed `sampling_seed + crc32(its prompt ids)`: a prompt draws the same
way whatever order the requests go out in (sessions interleave), so drawn runs repeat.
"""

from __future__ import annotations

import array
import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass, field


@dataclass
class Record:
    """One finished request, timed by the backend (seconds on one perf_counter clock)."""

    prompt_len: int
    start: float  # submit time
    first_token: float | None  # first output token arrived
    end: float  # last output arrived
    token_ids: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)  # loops run per generated token
    submissions: int = 0  # device submissions of this request (0: unknown)
    session: int | None = None
    turn: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_ids)
        return None if n < 2 or self.first_token is None else (self.end - self.first_token) / (n - 1)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str  # "burst" | "sessions"
    prompt_len: int = 512  # P: burst prompt length, the sessions' opening length
    output_len: int = 128  # O: tokens generated per request / turn
    concurrency: int = 32  # C: burst requests sent at once
    num_sessions: int = 64  # N
    num_turns: int = 6  # T
    user_len: int = 64  # U: tokens of each later user message (sessions)
    seed: int = 0
    token_low: int = 3  # lowest token id drawn (keeps clear of pad/bos/eos in most vocabularies)

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        for key in ("prompt_len", "output_len", "concurrency", "num_sessions", "num_turns", "user_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")

    @property
    def num_requests(self) -> int:
        return self.concurrency if self.name == "burst" else self.num_sessions * self.num_turns

    @property
    def max_context(self) -> int:
        """The longest prompt + output any request of this workload needs."""
        if self.name == "burst":
            return self.prompt_len + self.output_len
        return self.prompt_len + self.num_turns * self.output_len + (self.num_turns - 1) * self.user_len


class _Sampling:
    """The request fields every request of a backend sends (see the module note)."""

    def __init__(self, sampling: dict | None, sampling_seed: int | None):
        self.sampling = {"temperature": 0.0} | (sampling or {})
        self.sampling_seed = sampling_seed
        self.cut: list[Record] = []  # requests cancelled midway, as far as they got

    def request_fields(self, prompt_ids: list[int], max_tokens: int) -> dict:
        fields = dict(self.sampling, max_tokens=max_tokens, ignore_eos=True)
        if self.sampling_seed is not None:
            fields["seed"] = self.sampling_seed + zlib.crc32(array.array("q", prompt_ids).tobytes())
        return fields


class InProcessBackend(_Sampling):
    """Streams requests through an AsyncEngine; ignore_eos, exactly max_tokens tokens."""

    def __init__(self, aengine, sampling: dict | None = None, sampling_seed: int | None = None):
        super().__init__(sampling, sampling_seed)
        self.aengine = aengine

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Record:
        from loopjax.sampling_params import SamplingParams

        params = SamplingParams(**self.request_fields(prompt_ids, max_tokens))
        start = time.perf_counter()
        stream = await self.aengine.submit(prompt_ids, params)
        record = Record(prompt_len=len(prompt_ids), start=start, first_token=None, end=start)
        try:
            async for out in stream:
                now = time.perf_counter()
                if record.first_token is None and out.new_token_ids:
                    record.first_token = now
                record.end = now
                record.token_ids = out.token_ids  # a Snapshot (O(1)); a list once the stream ends
                loops = out.exit_loops or []
                record.exit_loops = loops if len(loops) == len(out.token_ids) else record.exit_loops + loops
                record.submissions = (out.metrics or {}).get("num_submissions") or 0
        except asyncio.CancelledError:
            self.cut.append(record)
            raise
        finally:
            stream.close()  # cut by --max-seconds (cancelled): abort the request, free its pages
            record.token_ids, record.exit_loops = list(record.token_ids), list(record.exit_loops)
        return record


class HttpBackend(_Sampling):
    """Streams requests from a loopjax server's /v1/completions (token-id prompts, SSE)."""

    def __init__(self, client, model: str, sampling: dict | None = None, sampling_seed: int | None = None):
        super().__init__(sampling, sampling_seed)
        self.client, self.model = client, model

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Record:
        body = {"model": self.model, "prompt": prompt_ids, "stream": True,
                "stream_options": {"include_usage": True}} | self.request_fields(prompt_ids, max_tokens)
        start = time.perf_counter()
        record = Record(prompt_len=len(prompt_ids), start=start, first_token=None, end=start)
        try:
            await self._stream(body, record)
        except asyncio.CancelledError:
            self.cut.append(record)
            raise
        return record

    async def _stream(self, body: dict, record: Record) -> None:
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"server answered {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error mid-stream: {chunk['error'].get('message')}")
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        record.first_token = record.first_token or now
                        record.token_ids += choice["token_ids"]
                        record.exit_loops += choice.get("exit_loops") or []
                    record.end = now
                if chunk.get("usage"):
                    record.submissions = int(chunk["usage"].get("submissions") or 0)


def random_tokens(rng: random.Random, n: int, vocab_size: int, low: int) -> list[int]:
    if vocab_size <= low:
        raise ValueError(f"vocab_size {vocab_size} leaves no token ids above {low}")
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def burst_prompts(spec: WorkloadSpec, vocab_size: int) -> list[list[int]]:
    """The burst's C prompts (bench/profile.py sends the same ones straight to an Engine)."""
    rng = random.Random(spec.seed)
    return [random_tokens(rng, spec.prompt_len, vocab_size, spec.token_low) for _ in range(spec.concurrency)]


async def run_burst(spec: WorkloadSpec, backend, vocab_size: int, on_done=None) -> list[Record]:
    prompts = burst_prompts(spec, vocab_size)

    async def one(prompt):
        record = await backend.generate(prompt, spec.output_len)
        if on_done is not None:
            on_done(record)
        return record

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def run_sessions(spec: WorkloadSpec, backend, vocab_size: int, on_done=None) -> list[Record]:
    # NOTE: every session's messages are drawn up front, so a run's prompts do not depend
    # on which session finishes first; only the answers (model output) feed back.
    rng = random.Random(spec.seed)
    scripts = [[random_tokens(rng, spec.prompt_len if t == 0 else spec.user_len, vocab_size, spec.token_low)
                for t in range(spec.num_turns)] for _ in range(spec.num_sessions)]

    async def session(index, messages):
        context, records = [], []
        for turn, message in enumerate(messages):
            context = context + message
            record = await backend.generate(context, spec.output_len)
            record.session, record.turn = index, turn
            context = context + record.token_ids
            records.append(record)
            if on_done is not None:
                on_done(record)
        return records

    results = await asyncio.gather(*(session(i, m) for i, m in enumerate(scripts)))
    return [r for records in results for r in records]


WORKLOADS = {"burst": run_burst, "sessions": run_sessions}


async def run_workload(spec: WorkloadSpec, backend, vocab_size: int, on_done=None) -> list[Record]:
    return await WORKLOADS[spec.name](spec, backend, vocab_size, on_done)
