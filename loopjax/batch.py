"""StepBatch: the device metadata of one step, and its host-side builder.

A step is a bucket of R rows (requests) and N packed tokens (prefill: prompt chunks of
different lengths concatenated without padding between them; decode: N = R, one token per
row). Padding rows/tokens beyond the real ones write to the drop slot, attend a harmless
row-0 context and yield no token. Every array has a static shape fixed by the bucket, and the
step's kind (`decode`) is a static field, so one compiled function serves every step of that
bucket and kind (a prefill bucket of R tokens over R rows is still a prefill).

The builder works on `RowInput`s (plain host data); the engine turns a scheduler plan into
them. Shapes: R = rows bucket, N = token bucket, M = max pages per row, H = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain

import jax
import numpy as np

from loopjax import exits
from loopjax.exits import ExitParams, ExitSpec
from loopjax.kv_cache import WRITE_EVERY_PLANE, WRITE_LOOP_PLANE
from loopjax.penalties import HistoryReset, build_reset
from loopjax.sampling import SamplingBatch
from loopjax.sampling_params import SamplingParams

# Huginn initial-state modes per token (`StepBatch.init_mode`).
INIT_ZERO, INIT_SEEDED, INIT_EXPLICIT, INIT_WARM = 0, 1, 2, 3  # WARM: the row's carried state


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    token_ids: jax.Array         # [N] i32  packed token ids (padding and tokens from the device: 0)
    token_from_device: jax.Array  # [N] bool  the id is the row's last sampled token, read from
    #                               DeviceState.last_tokens[token_slot] (sampled by a step in flight)
    positions: jax.Array         # [N] i32  absolute position of each token in its sequence
    row_of_token: jax.Array      # [N] i32  row of each token (padding tokens: row 0)
    slot_mapping: jax.Array      # [N] i32  flat KV slot page*S+offset (padding: drop slot)
    page_table: jax.Array        # [R, M] i32  pages of each row (unused entries: 0)
    last_token_index: jax.Array  # [R] i32  index in [0, N) of each row's last token this step
    row_is_real: jax.Array       # [R] bool  row yields a token this step (real, last chunk)
    row_loops: jax.Array         # [R] i32  loops each row runs (<= the submission's loop_end)
    carry_slot: jax.Array        # [R] i32  row's slot of the per-loop decode state (padding: last)
    token_slot: jax.Array        # [R] i32  row's slot of its last sampled token (padding: last)
    loop_begin: jax.Array        # [] i32  first loop of this submission (0 unless unfused)
    loop_end: jax.Array          # [] i32  one past the last loop of this submission
    sampling: SamplingBatch      # [R] per-row sampling settings (loopjax.sampling)
    exit_threshold: jax.Array    # [R] f32  Ouro Q-exit threshold (config default if unset)
    exit_skip: jax.Array         # [R] bool  adaptive "skip": the row stops at its exit loop
    exit: ExitParams | None      # [R] Huginn exit criteria (adaptive steps only)
    init_mode: jax.Array | None  # [N] i32  Huginn s0: INIT_ZERO / SEEDED / EXPLICIT / WARM
    init_seed: jax.Array | None  # [N] u32  Huginn s0 seed (INIT_SEEDED)
    init_state: jax.Array | None  # [N, H] Huginn explicit s0 (INIT_EXPLICIT), else zeros
    exit_step: jax.Array         # [R] i32  Ouro fixed exit loop (0-based; -1: none)
    exit_weighted: jax.Array     # [R] bool  Ouro weighted exit (read by weighted kinds only)
    page_plane: jax.Array        # [R, M] i32  Ouro 'shared': plane of a decode page, -1 full page
    write_plane: jax.Array       # [N] i32  Ouro 'shared': plane(s) a token writes (kv_cache.WRITE_*)
    history_reset: HistoryReset | None  # prefill: rows starting their token history (penalties.py);
    #                                     None in decode steps (a row starts it when it first emits)
    # static (pytree metadata: part of the jit key): a decode step, N = R and one token per
    # row (the attention takes the decode kernels), else a prefill of packed prompt chunks
    decode: bool = field(metadata=dict(static=True))


@dataclass
class StepResult:
    """Host copy of a step's outputs for the real rows (one read per submission); the logprob
    fields are None when no row asked for logprobs (Runner.read)."""

    tokens: np.ndarray       # [R] int32
    exit_loops: np.ndarray   # [R] int32
    logprobs: np.ndarray | None     # [R] f32
    top_ids: np.ndarray | None      # [R, k]
    top_logprobs: np.ndarray | None  # [R, k]
    ranks: np.ndarray | None = None  # [R] int32 the sampled token's rank (vLLM's rule: sampling.py)


@dataclass
class RowInput:
    """One row of a step, as host data."""

    token_ids: list[int]          # the tokens this step feeds (prompt chunk or 1 decode token)
    start_pos: int                # position of token_ids[0]
    pages: list[int]              # the row's pages, covering positions < start_pos + len
    emits: bool                   # sample a token from this row's last token this step
    loops: int                    # loops this row runs
    params: SamplingParams
    token_index: int = 0          # generated tokens so far (the sampled token's index)
    carry_slot: int | None = None  # slot of the request's device state (per-loop / warm start)
    token_slot: int | None = None  # slot of the request's last sampled token (rows that emit)
    input_on_device: bool = False  # the last of token_ids is a placeholder: the device reads the
    #                                token from token_slot (sampled by a step not yet read back)
    exit_threshold: float = 1.0
    exit_skip: bool = False       # stop at the exit loop (adaptive skip mode / exit trace)
    exit_spec: ExitSpec | None = None  # Huginn exit criterion of this row's token
    exit_step: int = -1           # Ouro: select loop k's state (-1: the threshold rule)
    exit_weighted: bool = False   # Ouro: logits = sum_i p_i * logits_i (weighted step kinds)
    init_mode: int = INIT_SEEDED  # Huginn only
    init_seed: int = 0
    init_states: np.ndarray | None = field(default=None, repr=False)  # [len(token_ids), H]
    page_planes: list[int] | None = None  # Ouro 'shared': per page, its plane (-1 full page)
    decoded: bool = False         # the tokens are decoded tokens (a decode step's)
    # (prompt ids, output ids so far, logit_bias pairs, allowed_token_ids or None): the row starts
    # its token slot's history
    # this step (a prefill row that gets its slot and whose params process logits)
    history: tuple | None = field(default=None, repr=False)
    bans: tuple = ()              # the sampled token's bad_words bans, (id, after) pairs (bad_words.py)


def build_step_batch(rows: list[RowInput], *, decode: bool, num_rows: int, num_tokens: int,
                     max_pages: int, page_size: int, drop_slot: int, loop_begin: int, loop_end: int,
                     pad_slot: int, hidden_size: int | None = None,
                     adaptive: bool = False) -> StepBatch:
    """Numpy StepBatch for `rows` padded to the bucket (num_rows, num_tokens).

    decode: a decode step (num_tokens == num_rows, one token per row), else a prefill;
    pad_slot: the carry and token slot of padding rows (and of rows without one);
    hidden_size: set for Huginn (the init_* fields), None for Ouro; adaptive: fill `exit`
    (Huginn criteria).

    NOTE: no numpy call per row: each field is gathered into one list (or, per token, one numpy
    expression) and converted once; built row by row, a 32-row decode step cost ~0.5 ms of host
    time, and one stream's step pays this builder's fixed cost every token."""
    n, counts = len(rows), [len(r.token_ids) for r in rows]
    if decode and (num_tokens != num_rows or any(c != 1 for c in counts)):
        raise ValueError(f"a decode step feeds one token per row: {num_tokens} tokens over "
                         f"{num_rows} rows, row lengths {counts}")
    if n > num_rows:
        raise ValueError(f"{n} rows exceed the bucket of {num_rows}")
    total = sum(counts)
    if total > num_tokens:
        raise ValueError(f"{total} tokens exceed the bucket of {num_tokens}")
    starts = [r.start_pos for r in rows]
    needed = [-(-(s + c) // page_size) for s, c in zip(starts, counts)]  # pages of positions < end
    _check_rows(rows, needed, max_pages)
    ends = list(accumulate(counts))  # one past each row's last token
    if decode:  # one token per row
        row_of, pos = np.arange(n), np.array(starts, np.int64)
    else:
        row_of = np.repeat(np.arange(n), counts)
        pos = np.arange(total) + np.array([s - e + c for s, e, c in zip(starts, ends, counts)],
                                          np.int64)[row_of]
    ids = list(chain.from_iterable(r.token_ids for r in rows))
    on_device = [False] * num_tokens
    for end, row in zip(ends, rows):
        if row.input_on_device:  # its last input is the row's token on the device
            ids[end - 1], on_device[end - 1] = 0, True
    # Page table: each row's first `needed` pages, then 0 (planes below).
    page_table = np.zeros((num_rows, max_pages), np.int32)
    _fill_leading(page_table, [r.pages for r in rows], needed)
    last, row_loops, carry_slot, token_slot, exit_step, row_write = _columns(
        [[e - 1 for e in ends], [r.loops for r in rows],
         [pad_slot if r.carry_slot is None else r.carry_slot for r in rows],
         [pad_slot if r.token_slot is None else r.token_slot for r in rows], [r.exit_step for r in rows],
         [WRITE_EVERY_PLANE if r.decoded else WRITE_LOOP_PLANE for r in rows]],
        num_rows, [0, 0, pad_slot, pad_slot, -1, WRITE_LOOP_PLANE], np.int32)
    real, skip, weighted = _columns([[r.emits for r in rows], [r.exit_skip for r in rows],
                                     [r.exit_weighted for r in rows]], num_rows, [False] * 3, bool)
    # Per-token int32 fields in one block: the real tokens, then each field's padding value.
    tokens = np.zeros((5, num_tokens), np.int32)
    token_ids, positions, row_of_token, slot_mapping, write_plane = tokens
    slot_mapping[total:], write_plane[total:] = drop_slot, WRITE_LOOP_PLANE
    token_ids[:total] = ids
    positions[:total] = pos
    row_of_token[:total] = row_of
    page_of, offset = np.divmod(pos, page_size)
    slot_mapping[:total] = page_table[row_of, page_of] * page_size + offset
    # A prompt token writes its loop's plane, a decoded token every plane of a full page and its
    # own plane of a decode page (page_plane >= 0).
    write_plane[:total] = row_write[row_of]
    page_plane = np.full((num_rows, max_pages), -1, np.int32)
    if any(r.page_planes is not None for r in rows):
        _fill_leading(page_plane, [r.page_planes if r.page_planes is not None else [-1] * k
                                   for r, k in zip(rows, needed)], needed)
        planes, written = page_plane[row_of, page_of], write_plane[:total]
        np.copyto(written, planes, where=(planes >= 0) & (written == WRITE_EVERY_PLANE))
    init_mode = init_seed = init_state = None
    if hidden_size is not None:  # Huginn
        init_mode, init_seed = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.uint32)
        init_mode[:total] = np.array([r.init_mode for r in rows], np.int32)[row_of]
        init_seed[:total] = np.array([r.init_seed % 2**32 for r in rows], np.uint32)[row_of]
        init_state = np.zeros((num_tokens, hidden_size), np.float32)
        for row, end, count in zip(rows, ends, counts):
            if row.init_mode == INIT_EXPLICIT:
                init_state[end - count:end] = row.init_states
    exit_params = None
    if adaptive and hidden_size is not None:
        exit_params = exits.exit_params([r.exit_spec or exits.ExitSpec() for r in rows], num_rows)
    sampling = SamplingBatch.from_params([r.params for r in rows], num_rows,
                                         [r.token_index for r in rows], [r.bans for r in rows])
    threshold = np.array([r.exit_threshold for r in rows] + [1.0] * (num_rows - n), np.float32)
    from_device = np.array(on_device, bool)
    history_reset = None if decode else build_reset([r.history for r in rows], num_rows,
                                                    max_pages * page_size)
    return StepBatch(token_ids, from_device, positions, row_of_token, slot_mapping, page_table, last,
                     real, row_loops, carry_slot, token_slot, np.int32(loop_begin), np.int32(loop_end),
                     sampling, threshold, skip, exit_params, init_mode, init_seed, init_state,
                     exit_step, weighted, page_plane, write_plane, history_reset, decode)


def _fill_leading(table: np.ndarray, values: list, counts: list[int]) -> None:
    """Row i of `table` starts with values[i][:counts[i]] (its other entries keep their fill):
    one conversion of the real entries only. At 128 rows of 2,048-token contexts, padded
    per-row lists made this ~3x slower, the largest part of a decode step's batch."""
    total = sum(counts)
    leading = np.arange(table.shape[1]) < np.array(counts, np.int64).reshape(-1, 1)
    table[:len(counts)][leading] = np.fromiter(chain.from_iterable(v[:k] for v, k in zip(values, counts)),
                                               table.dtype, total)


def _columns(columns: list[list], size: int, fills: list, dtype) -> np.ndarray:
    """[len(columns), size]: each per-row list padded with its fill, converted in one call."""
    flat = []
    for values, fill in zip(columns, fills):
        flat += values
        flat += [fill] * (size - len(values))
    return np.array(flat, dtype).reshape(len(columns), size)


def _check_rows(rows: list[RowInput], needed: list[int], max_pages: int) -> None:
    """The first bad row raises: fewer pages than its positions need (`needed`), more than
    the table holds, or an input on the device without a token slot."""
    for i, (row, num_pages) in enumerate(zip(rows, needed)):
        if len(row.pages) < num_pages:
            end = row.start_pos + len(row.token_ids)
            raise ValueError(f"row {i}: {len(row.pages)} pages cannot hold {end} positions")
        if num_pages > max_pages:
            raise ValueError(f"row {i}: {num_pages} pages exceed the table width {max_pages}")
        if row.input_on_device and row.token_slot is None:
            raise ValueError(f"row {i}: an input on the device needs a token slot")
        if row.history is not None and (row.decoded or row.token_slot is None):
            raise ValueError(f"row {i}: a token history starts in a prefill row with a token slot")


def greedy_row(token_ids, start_pos: int, pages, *, loops: int, emits: bool = True,
               params: SamplingParams | None = None, **kw) -> RowInput:
    """A RowInput with greedy sampling defaults (tests, benchmarks)."""
    return RowInput(list(token_ids), start_pos, list(pages), emits, loops,
                    params or SamplingParams(temperature=0.0, seed=0), **kw)


@dataclass(frozen=True)
class Buckets:
    """The compiled step shapes, and the smallest one that holds a step's rows."""

    decode_rows: tuple[int, ...]             # decode row counts (N = R)
    prefill: tuple[tuple[int, int], ...]     # prefill (rows, tokens), sorted
    page_widths: tuple[int, ...]             # decode page-table widths (context buckets)
    page_size: int
    drop_slot: int
    pad_slot: int                            # carry / token slot of padding rows
    hidden_size: int | None                  # Huginn: the init_* fields; None for Ouro

    def build(self, rows: list[RowInput], *, decode: bool, loop_begin: int, loop_end: int,
              num_rows: int = 0, num_tokens: int = 0, page_width: int = 1,
              adaptive: bool = False) -> StepBatch:
        """Numpy StepBatch of `rows` in the smallest bucket holding them and at least
        (num_rows, num_tokens); decode: the narrowest page-table width >= every row's context
        and page_width."""
        num_rows = max(num_rows, len(rows))
        num_tokens = max(num_tokens, sum(len(r.token_ids) for r in rows))
        width = self.page_widths[-1]
        if decode:
            fits = [r for r in self.decode_rows if r >= max(num_rows, num_tokens)]
            if not fits:
                raise ValueError(f"{num_rows} decode rows exceed the largest bucket {self.decode_rows[-1]}")
            num_rows = num_tokens = fits[0]
            needed = max([-(-(r.start_pos + 1) // self.page_size) for r in rows] + [page_width])
            width = next(w for w in self.page_widths if w >= needed)
        else:
            fits = [(r, n) for r, n in self.prefill if r >= num_rows and n >= num_tokens]
            if not fits:
                raise ValueError(f"prefill of {num_rows} rows / {num_tokens} tokens exceeds every bucket")
            num_rows, num_tokens = fits[0]
        return build_step_batch(rows, decode=decode, num_rows=num_rows, num_tokens=num_tokens,
                                max_pages=width, page_size=self.page_size, drop_slot=self.drop_slot,
                                loop_begin=loop_begin, loop_end=loop_end,
                                pad_slot=self.pad_slot, hidden_size=self.hidden_size,
                                adaptive=adaptive)
