"""Request: the host state of one generation request (pure Python, imports no JAX).

Conventions:
- A request's token sequence is `all_token_ids = prompt_token_ids + output_token_ids`.
  Position p of that sequence has its KV in slot `page_ids[p // S] * S + p % S` (S = page size).
- `num_computed_tokens` counts positions whose KV is in the pool or written by a dispatched
  step (the device runs steps in dispatch order). `num_pending_tokens` counts tokens sampled by
  dispatched steps whose update has not come yet: their ids live only on the device, and
  `num_planned_tokens = num_tokens + num_pending_tokens`. A DECODING request has
  `num_computed_tokens == num_planned_tokens - 1`: its last (sampled) token is the next
  step's input (read on the device when it is still pending).
- Preemption by recompute frees the pages and sets `num_computed_tokens = 0` but keeps the
  generated tokens; the request is then prefilled again over `all_token_ids` (its "prompt"
  for prefill purposes), and the chunk that completes it samples the next token.
- Depth: `max_loops` is the loops each generated token runs (fixed depth), or the cap when
  `adaptive` (an exit rule may stop earlier; such rows are planned one loop per submission).
- Prefix cache (`prefix_cache.py`): `cache_salt` names what besides the token ids and the
  loop count determines the request's KV (Huginn: the initial-state mode and seed); None
  means its KV cannot be reproduced from tokens (explicit or per-request-random states), so
  it never shares pages. `page_keys[i]` is the key of full page i of `all_token_ids`,
  computed once per page and kept through preemption (the tokens never change).
- `RequestOutput` is what the engine reports for a request after a step; `check_prompt_ids`
  validates a prompt before anything is queued.
- `output_token_ids` and `exit_loops` are append-only (preemption keeps them): a RequestOutput
  holds Snapshots of them, not copies.
- The scheduler owns every field except `sampling_params`, `adaptive`, `max_loops`,
  `cache_salt` and `whole_prefill`, which the engine sets before `Scheduler.add`.
- `whole_prefill`: a Huginn prompt with an exit criterion exits as one, decided on its last
  position (the reference's adaptive prefill), so a prefill chunk must hold all of it: one
  that fits `max_prefill_tokens` waits for a step with the budget rather than being split by
  a batch-mate (a longer one, e.g. prompt + outputs recomputed after preemption, is chunked).
  So is a prompt in a Huginn ring that wraps within its depth (`KVLayout.ring_wraps`): a
  later step would read the earlier tokens' last write of a slot, not their entry of its loop.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Finish reasons (OpenAI's words; "abort" for a request the client dropped).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class StepFailedError(RuntimeError):
    """Engine.step()'s one line when a step failed on the device: `request_ids` were aborted
    (their outputs come with the next step); `recovered` when a fresh device state was made, so
    the engine serves on (the server then fails only those requests)."""

    def __init__(self, message: str, request_ids: list[str], recovered: bool):
        super().__init__(message)
        self.request_ids, self.recovered = request_ids, recovered


class RequestPhase(enum.Enum):
    WAITING = "waiting"        # queued, holds no page, nothing computed
    PREFILLING = "prefilling"  # admitted; some prompt chunks computed, more to come
    DECODING = "decoding"      # prompt computed; each decode step adds one token
    PREEMPTED = "preempted"    # pages taken back; queued at the front to be recomputed
    FINISHED = "finished"      # done (finish_reason says why); holds no page


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # loopjax.sampling_params.SamplingParams; None = defaults
    adaptive: bool = False       # an exit rule may end a token before max_loops
    max_loops: int | None = None  # loops per token (cap when adaptive); None = the model's depth
    arrival_time: float | None = None  # clock time of `add` (set by the scheduler if None)
    cache_salt: tuple | None = None  # KV inputs besides tokens/loops; None = never share pages
    whole_prefill: bool = False  # one prefill step (Huginn criterion, wrapping ring): never split if it fits
    # ---- scheduler-owned state
    output_token_ids: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)  # loops run, per output token
    phase: RequestPhase = RequestPhase.WAITING
    arrival_order: int = -1       # FCFS rank, unique; set by Scheduler.add
    num_computed_tokens: int = 0  # positions whose KV is in the pool
    num_loops_done: int = 0       # per-loop decode: loops already run for the pending token
    num_pending_tokens: int = 0   # sampled by dispatched steps, not yet read back (0..2)
    page_ids: list[int] = field(default_factory=list)  # the request's pages, in position order
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache key of each full page so far
    num_offered_pages: int = 0    # leading page_ids already offered to the prefix cache (hit or
    #                               published); 0 after free
    num_cached_tokens: int = 0    # tokens the last admission took from the prefix cache
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_prefill_submissions: int = 0  # prefill steps this request took part in
    num_decode_submissions: int = 0   # decode steps this request took part in
    num_decode_tokens: int = 0        # output tokens produced by decode steps

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)

    # ---- sizes
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the pending ones: the length the next step builds on."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def num_pages_needed(self, page_size: int, num_tokens: int | None = None) -> int:
        """Pages that hold `num_tokens` positions (default: every token of the request)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        return -(-n // page_size)

    @property
    def is_finished(self) -> bool:
        return self.phase is RequestPhase.FINISHED

    # ---- sampling limits (SamplingParams is opaque here except these two fields)
    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling_params, "max_tokens", None)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.sampling_params, "stop_token_ids", ()) or ())

    # ---- timing (seconds of the scheduler's clock)
    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first one (None with fewer than two tokens)."""
        if self.num_output_tokens < 2 or self.last_token_time is None or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def decode_submissions_per_token(self) -> float | None:
        """Decode submissions per decode-produced token: 1.0 for fused fixed-depth decode."""
        if self.num_decode_tokens == 0:
            return None
        return self.num_decode_submissions / self.num_decode_tokens


class Snapshot(Sequence):
    """The first `len(items)` items of an append-only list, as they are now: what a
    RequestOutput reports of a request's growing lists without copying them every step (O(1)
    per step, not O(tokens)). Later appends do not show; slicing and `+` give lists; equal to
    any list or tuple with the same items."""

    __slots__ = ("_items", "_len")

    def __init__(self, items: list):
        self._items, self._len = items, len(items)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step == 1:
                return self._items[start:max(start, stop)]
            return [self._items[i] for i in range(start, stop, step)]
        if not -self._len <= index < self._len:
            raise IndexError("Snapshot index out of range")
        return self._items[index % self._len]

    def __iter__(self):
        return itertools.islice(self._items, self._len)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # equal to lists, which are unhashable

    def __add__(self, other) -> list:  # snapshot + list (or any sequence): a new list
        return self[:] + list(other)

    def __radd__(self, other) -> list:  # list + snapshot: a new list (e.g. the next turn's prompt)
        return list(other) + self[:]

    def __repr__(self) -> str:
        return repr(self[:])


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step. The cumulative fields are Snapshots
    of the request's lists (append-only), so reporting a step costs no copy of its history."""

    request_id: str
    new_token_ids: list[int]              # tokens produced by this step
    token_ids: Sequence[int]              # every generated token so far
    finished: bool
    finish_reason: str | None             # 'stop' | 'length' | 'abort' | None
    exit_loops: Sequence[int]             # loops of the selected state, per generated token
    # Generated text once finished (stop strings set: as decoded so far, trimmed at a match);
    # None before that, and without a tokenizer or with detokenize=False.
    text: str | None = None
    logprobs: Sequence[float] | None = None  # per generated token (when asked)
    top_logprobs: Sequence[list[tuple[int, float]]] | None = None
    metrics: dict = field(default_factory=dict)  # ttft, tpot, num_submissions (a count), *_per_token
    # Finished with 'stop': the stop string that matched, or the stop token id (None for the
    # tokenizer's EOS), as vLLM's; None otherwise.
    stop_reason: int | str | None = None
    # Per generated token (when logprobs are asked): vLLM's Logprob.rank of the token, its place
    # in top_logprobs when listed there, else the number of vocabulary log-probs >= its own.
    ranks: Sequence[int] | None = None


def holds_bools(ids) -> bool:
    """Whether a token-id sequence holds a bool, which numpy reads as an int ([5, True]); an
    array's dtype says it (a jax array's items are slow to walk). Neither bool type can be
    subclassed, so the items' exact types say it: gathered in C, not one isinstance per id
    (a long prompt's check was most of add_request's time)."""
    return not hasattr(ids, "dtype") and not _BOOL_TYPES.isdisjoint(map(type, ids))


_BOOL_TYPES = frozenset({bool, np.bool_})


def check_prompt_ids(prompt, vocab_size: int) -> list[int]:
    """The prompt as a list of ints, or a one-line ValueError (not ids, empty, out of vocabulary)."""
    if isinstance(prompt, str | bytes) or not hasattr(prompt, "__len__") or getattr(prompt, "ndim", 1) == 0:
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(prompt).__name__}")
    if not len(prompt):
        raise ValueError("empty prompt: give at least one token id")
    array = np.asarray(prompt)
    if array.ndim != 1 or array.dtype.kind not in "iu" or holds_bools(prompt):
        raise ValueError("prompt_token_ids must be a flat list of integer token ids")
    ids = array.tolist()  # Python ints
    if array.min() < 0 or array.max() >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_exit_depth(params, depth: int, *, weighted_steps: bool, fused: bool,
                     adaptive_steps: bool = True) -> None:
    """A one-line ValueError for exit settings of `params` (a SamplingParams) that do not fit
    the request's depth (its loops, or the engine's default) or the engine's steps (weighted
    exit compiled, fused decode, adaptive steps compiled or compilable): refused, not capped,
    as SamplingParams refuses them when `loops` is given."""
    if params.exit_step is not None and params.exit_step >= depth:
        raise ValueError(f"exit_step={params.exit_step} must be below the depth {depth}")
    if params.exit_trace is not None and max(params.exit_trace) > depth:
        raise ValueError(f"exit_trace entry {max(params.exit_trace)} exceeds the depth {depth}")
    if params.exit_criterion is not None and params.exit_min_loops > depth:  # it would never check
        raise ValueError(f"exit_min_loops={params.exit_min_loops} exceeds the depth {depth}")
    if params.stops_adaptively and not adaptive_steps:  # NOTE: its step would raise, aborting batch-mates
        raise ValueError("exit_mode='skip', exit_trace and exit_criterion run in adaptive steps; this "
                         "strict engine compiled none (adaptive_exit=False)")
    if params.exit_weighted and not weighted_steps:
        raise ValueError("exit_weighted needs an engine with enable_weighted_exit=True")
    if params.exit_weighted and not fused:
        raise ValueError("exit_weighted runs in fused steps; this engine has fused_decode=False")
