"""On-device sampling: pure, jit-friendly functions over static shapes.

The runner builds a `SamplingBatch` on the host (`SamplingBatch.from_params`, numpy, one row
per decode row, padded to the row bucket R) and calls `sample` inside its jitted step, with
the logits in the model's dtype, and `greedy=True` in the executable of decode steps whose
rows are all greedy (StepKind.greedy); the only values read back are the sampled tokens (and
logprobs when asked).

Semantics of one row, in order (vLLM's: its min-p processor runs before top-k / top-p):
  temperature -> min-p -> top-k -> top-p (over the min-p and top-k survivors, renormalised) -> draw.
- Greedy rows (SamplingParams.is_greedy: temperature < GREEDY_EPS; `from_params` stores their
  temperature as 0) take the argmax of the raw logits, first index on ties (like torch); the
  whole batch shares one argmax.
- A token tied with the top-k / top-p boundary value is kept too (the mask is a value
  threshold), so the kept set never depends on the sort's tie order.
- min-p keeps tokens whose probability is >= min_p times the row's largest (a threshold on
  the scaled logits); top-k and top-p then see only its survivors, so top-p's mass is theirs
  (Hugging Face's order, min-p last, counted the mass of tokens min-p drops).
- The draw is argmax(masked logits + Gumbel noise) with the row's key
  `fold_in(key(seed), token_index)`: it depends only on the request's seed and the index
  of the token being generated (0 = first output token), never on the batch.
- Logprobs are those of the model's distribution: log_softmax(raw logits) at the chosen
  token, plus the `num_top_logprobs` largest (ids, values), and the chosen token's rank: the
  number of vocabulary log-probs >= its own (itself included, so ties rank it last), vLLM's rule.
- min_tokens: until a row has generated that many tokens, its stop ids (the engine adds EOS
  to them) are set to -inf before the choice (as Hugging Face's MinNewTokensLengthLogitsProcessor);
  its logprobs stay the model's. bad_words the same way, a ban that depends on the output's
  last token checked against `prev_tokens` (loopjax/bad_words.py).
- Penalties and logit_bias (`processed` rows, full samplers only): loopjax/penalties.py, on
  f32 logits after min_tokens; greedy rows take the f32 argmax of the result, drawing rows
  draw from it rounded to the logits' dtype (as every logit is). Logprobs stay the model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import penalties
from loopjax.sampling_params import GREEDY_EPS, SamplingParams

# Rows whose top_k is in 1..TOP_K_CAP are filtered from the TOP_K_CAP largest values only
# (top-p over the top-k survivors needs only them).
TOP_K_CAP = 128
# The static width of `SamplingBatch.suppressed`: a row's stop token ids (EOS included) while
# under its min_tokens, then the bans of its bad_words (at most one per token sequence), share it.
MAX_BANNED_TOKENS = 64
# `top_k` takes more than TWO_STAGE_MIN_K values in two stages, from chunks this wide.
TWO_STAGE_MIN_K, TOP_K_CHUNK = 16, 1024
INT32_MAX = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Device sampling settings of one step; padded rows are greedy and their token unused."""

    temperature: jax.Array  # [R] f32; < GREEDY_EPS means greedy
    top_k: jax.Array  # [R] i32; <= 0 (or >= V) means off
    top_p: jax.Array  # [R] f32 in (0, 1]; >= 1 means off
    min_p: jax.Array  # [R] f32 in [0, 1]; 0 means off
    seed: jax.Array  # [R, 2] u32; threefry key words (seed >> 32, seed & 0xffffffff)
    token_index: jax.Array  # [R] i32; index of the token being generated (0 = first output)
    # [R, MAX_BANNED_TOKENS, 2] i32; (id, after): the row may not sample id (-1: none) if after
    # < 0 or its last output token is after (bad_words.py)
    suppressed: jax.Array
    repetition_penalty: jax.Array  # [R] f32; 1 means off
    frequency_penalty: jax.Array  # [R] f32; 0 means off
    presence_penalty: jax.Array  # [R] f32; 0 means off
    processed: jax.Array  # [R] bool; the row's logits go through its token history (penalties.py)

    @classmethod
    def from_params(cls, params_list: Sequence[SamplingParams], num_rows: int,
                    step_counts: Sequence[int],
                    bans: Sequence[Sequence[tuple[int, int]]] = ()) -> SamplingBatch:
        """Host-side (numpy) batch: row i gets params_list[i], generating its token
        number step_counts[i], with its bad_words' (id, after) pairs bans[i] (none past
        len(bans)); rows past len(params_list) up to num_rows are padding."""
        n = len(params_list)
        if num_rows < n:
            raise ValueError(f"num_rows must be >= len(params_list) = {n}, got {num_rows}")
        if len(step_counts) != n:
            raise ValueError(f"step_counts must have one entry per params ({n}), got {len(step_counts)}")
        # NOTE: one conversion per dtype, no numpy call per row (host time of every step)
        floats = np.zeros((6, num_rows), np.float32)
        floats[[1, 3]] = 1.0  # top_p, repetition_penalty off
        # NOTE: a greedy row's temperature is 0 here: the host's is_greedy decides (a temperature
        # just below GREEDY_EPS rounds to f32(GREEDY_EPS), which the device would draw with)
        floats[:, :n] = [[0.0 if p.is_greedy else p.temperature for p in params_list],
                         [p.top_p for p in params_list],
                         [p.min_p for p in params_list], [p.repetition_penalty for p in params_list],
                         [p.frequency_penalty for p in params_list],
                         [p.presence_penalty for p in params_list]]
        ints = np.zeros((2, num_rows), np.int32)
        # NOTE: a top_k of V or more is off, so any larger one (a request may send 2**31) is
        # stored as the int32 maximum, not overflowed (which raised in the engine thread).
        ints[:, :n] = [[min(p.top_k, INT32_MAX) for p in params_list], list(step_counts)]
        seed = np.zeros((num_rows, 2), np.uint32)
        if n:  # negative seeds wrap, as a 64-bit two's complement
            seed[:n] = [((s := p.seed % 2**64) >> 32, s & 0xFFFFFFFF) for p in params_list]
        (temperature, top_p, min_p, repetition, frequency, presence), (top_k, token_index) = floats, ints
        processed = np.zeros(num_rows, bool)
        processed[:n] = [p.processes_logits for p in params_list]
        # Before its min_tokens, a row may not sample its stop ids (the engine adds EOS to them);
        # its bad_words' bans follow them
        suppressed = np.full((num_rows, MAX_BANNED_TOKENS, 2), -1, np.int32)
        for i, (p, index) in enumerate(zip(params_list, step_counts)):
            pairs = bans[i] if i < len(bans) else ()
            num_ids = len(p.stop_token_ids) if index < p.min_tokens else 0
            if num_ids:
                check_suppressible(p, len(pairs))
                # an id past the int32 range is no token (nothing to suppress): -1, as padding is
                suppressed[i, :num_ids, 0] = [t if t <= INT32_MAX else -1 for t in p.stop_token_ids]
            if pairs:
                suppressed[i, num_ids:num_ids + len(pairs)] = pairs
        return cls(temperature, top_k, top_p, min_p, seed, token_index, suppressed, repetition,
                   frequency, presence, processed)


def check_suppressible(params: SamplingParams, num_bad_word_sequences: int = 0) -> None:
    """One-line ValueError when params has min_tokens and more stop ids (EOS included, as the
    engine adds it) than a row can suppress beside its bad_words' bans (one per token sequence
    at most), or allows only tokens it suppresses."""
    room = MAX_BANNED_TOKENS - num_bad_word_sequences
    if params.min_tokens and len(params.stop_token_ids) > room:
        beside = f" beside {num_bad_word_sequences} bad_words token sequences" * bool(num_bad_word_sequences)
        raise ValueError(f"min_tokens suppresses at most {room} stop token ids (EOS included){beside}, "
                         f"got {len(params.stop_token_ids)}")
    if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= set(
            params.stop_token_ids):
        raise ValueError("allowed_token_ids holds only stop token ids (EOS included), which min_tokens "
                         "suppresses: no token could be generated")


def row_keys(batch: SamplingBatch) -> jax.Array:
    """Typed threefry keys [R]: fold_in(key(seed), token_index); equals
    `jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), t)` for 0 <= seed < 2**31."""
    keys = jax.random.wrap_key_data(batch.seed, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, batch.token_index)


def sample(logits: jax.Array, batch: SamplingBatch, *, num_top_logprobs: int,
           greedy: bool = False, history: penalties.TokenHistory | None = None,
           prev_tokens: jax.Array | None = None):
    """Sample one token per row.

    logits: [R, V] raw model logits, f32 or the model's 16-bit dtype (bf16 / f16: the draw
    sorts their 16-bit order keys, `scale_and_sort`); num_top_logprobs: static k >= 0.
    greedy: static; the caller knows every real row is greedy (padding rows are): tokens are
    the argmax, no filter, sort or noise, and every output is bitwise what the full path gives
    for greedy rows (StepKind.greedy).
    history: the rows' token histories ([R, V] each, `penalties.rows_of`) for the `processed`
    rows' penalties and bias; None in the greedy sampler (no row processes logits there).
    prev_tokens: [R] i32, each row's last output token (a decode row's input): the bans that
    depend on it apply where it matches; None: none of them applies.
    Returns tokens [R] i32, logprobs [R] f32 (chosen token), top_ids [R, k] i32,
    top_logprobs [R, k] f32 (descending), ranks [R] i32 (chosen token; module note).
    """
    if not 0 <= num_top_logprobs <= logits.shape[-1]:
        raise ValueError(f"num_top_logprobs must be in [0, {logits.shape[-1]}], got {num_top_logprobs}")
    if logits.dtype.itemsize not in _ORDER_KEY_TYPES:
        logits = logits.astype(jnp.float32)
    with jax.named_scope("sample"):
        raw = logits.astype(jnp.float32)  # logprobs are the model's, suppression aside
        logits = _suppress(logits, batch.suppressed, prev_tokens)
        scores = logits.astype(jnp.float32)
        if history is not None:
            scores = penalties.apply(scores, history, repetition=batch.repetition_penalty,
                                     frequency=batch.frequency_penalty,
                                     presence=batch.presence_penalty, processed=batch.processed)
            logits = scores.astype(logits.dtype)  # other rows: the same bits
        tokens = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        if not greedy:
            # NOTE: branch-free: the draw (noise for R x V and the filters) runs even when every
            # row is greedy. A lax.cond / lax.switch on a device value makes XLA:GPU read it back
            # to the host in the middle of the step (a sync the engine avoids): measured in run
            # 15, a cond skipping the draw on all-greedy batches made the 32-row Ouro-1.4B step
            # 2.6% faster back to back, the 1-row step 28% slower, and burst-32 no faster. The
            # host picks the greedy executable instead (StepKind.greedy).
            rows_greedy = batch.temperature < GREEDY_EPS
            tokens = jnp.where(rows_greedy, tokens, _draw(logits, batch, rows_greedy))
        lse = jax.nn.logsumexp(raw, axis=-1)
        chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse
        # NOTE: compared as log-probs (as vLLM ranks them): the shift may round close logits to one
        ranks = jnp.sum(raw - lse[:, None] >= chosen[:, None], axis=-1, dtype=jnp.int32)
        if num_top_logprobs > 0:
            top_vals, top_ids = top_k(raw, num_top_logprobs)
            top_logprobs = top_vals - lse[:, None]
        else:
            top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
            top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_logprobs, ranks


def top_k(x, k: int):
    """jax.lax.top_k(x, k) over the last axis of x [R, V]: the same values and ids (equal values
    lower id first). For k > TWO_STAGE_MIN_K in two stages: the top k of each TOP_K_CHUNK-wide
    chunk (the last padded with -inf), then the top k of those candidates. XLA:GPU sorts whole
    rows there; on the H200 (bench/RESULTS.md run 25, call 1) k = 20 over [32, 49152] f32 took 93
    against 239 us, [32, 65536] 118 against 308, [1, 49152] 45 against 113."""
    r, v = x.shape
    if k <= TWO_STAGE_MIN_K or k > TOP_K_CHUNK or v <= TOP_K_CHUNK:
        return jax.lax.top_k(x, k)
    chunks = -(-v // TOP_K_CHUNK)
    x = jnp.pad(x, ((0, 0), (0, chunks * TOP_K_CHUNK - v)), constant_values=-jnp.inf)
    vals, ids = jax.lax.top_k(x.reshape(r, chunks, TOP_K_CHUNK), k)
    ids = ids + (jnp.arange(chunks, dtype=ids.dtype) * TOP_K_CHUNK)[None, :, None]
    vals, pick = jax.lax.top_k(vals.reshape(r, chunks * k), k)  # chunk order keeps ties by id
    return vals, jnp.take_along_axis(ids.reshape(r, chunks * k), pick, axis=-1)


def _suppress(logits, suppressed, prev_tokens):
    """logits with -inf at each row's suppressed ids [R, W, 2] whose condition holds (-1 ids
    drop out): rows under their min_tokens cannot pick a stop token, nor any row the end of a
    bad word; with none, the logits are unchanged bit for bit."""
    ids, after = suppressed[..., 0], suppressed[..., 1]
    applies = after < 0 if prev_tokens is None else (after < 0) | (after == prev_tokens[:, None])
    ids = jnp.where((ids < 0) | ~applies, logits.shape[-1], ids)  # out of range: dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def _draw(logits, batch, greedy):
    """Tokens [R] i32 drawn from the filtered, temperature-scaled distribution."""
    scaled, sorted_desc = scale_and_sort(logits, batch, greedy)
    masked = jnp.where(scaled >= filter_threshold(scaled, sorted_desc, batch, greedy), scaled, -jnp.inf)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(row_keys(batch))
    return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)


def scale_and_sort(logits: jax.Array, batch: SamplingBatch, greedy: jax.Array):
    """(scaled [R, V] f32: the logits over each row's temperature (greedy rows: 1), the same
    values sorted descending [R, V] f32). Sorted in the logits' own dtype, then scaled:
    x -> f32(x) / t (t > 0 per row) is monotone, so this is the sort of the scaled values
    exactly, ties included, and 16-bit logits sort 16-bit keys (run 16, H200: [32, 49152]
    138 vs 238 us for the f32 ones)."""
    temperature = jnp.where(greedy, 1.0, batch.temperature)[:, None]
    scaled = logits.astype(jnp.float32) / temperature
    return scaled, sort_descending(logits).astype(jnp.float32) / temperature


def filter_threshold(scaled: jax.Array, sorted_desc: jax.Array, batch: SamplingBatch,
                     greedy: jax.Array) -> jax.Array:
    """Per-row value threshold [R, 1]: a token is kept iff its scaled logit >= it.
    scaled: [R, V] f32 temperature-scaled logits; sorted_desc: [R, V] f32, the same values
    sorted descending (`scale_and_sort`).

    Combines top-k, top-p and min-p. The exact path a batch needs is one of: 0) no sampled
    row uses top-k / top-p: min-p only; 1) every filtering row has top_k in 1..TOP_K_CAP: from
    the TOP_K_CAP largest values (what `lax.top_k` returns); 2) otherwise from the full
    descending sort. Branch-free (see `sample`): one sort of every row per step feeds paths 1
    and 2 (its first TOP_K_CAP columns are the top-k values) and the batch's path is selected.
    On the H200 the sort of [128, 65536] f32 costs ~0.4 ms (`sort_descending`; `lax.top_k` of
    128 as much as the float-comparator sort, ~0.6 ms); of bf16 keys about half.
    """
    vocab = scaled.shape[-1]
    top_k = jnp.where((batch.top_k <= 0) | (batch.top_k >= vocab), 0, batch.top_k)
    top_p_on = batch.top_p < 1.0
    filtering = ~greedy & ((top_k > 0) | top_p_on)
    capped = (top_k > 0) & (top_k <= TOP_K_CAP)
    cap = min(TOP_K_CAP, vocab)
    # min-p first (vLLM's order): p_i >= min_p * p_max  <=>  scaled_i >= max + log(min_p);
    # log(0) = -inf keeps all. Top-k / top-p see its survivors only (the rest -inf, no mass).
    min_p_thr = sorted_desc[:, :1] + jnp.log(batch.min_p)[:, None]
    survivors = jnp.where(sorted_desc >= min_p_thr, sorted_desc, -jnp.inf)
    from_top_k = _topk_topp_threshold(survivors[:, :cap], top_k, batch.top_p)
    from_sort = _topk_topp_threshold(survivors, top_k, batch.top_p)
    thr = jnp.where(~jnp.any(filtering), -jnp.inf,
                    jnp.where(jnp.all(~filtering | capped), from_top_k, from_sort))
    # NOTE: a threshold of -inf (fewer min-p survivors than top-k keeps) leaves min-p's
    return jnp.maximum(thr, min_p_thr)


def sort_descending(x: jax.Array) -> jax.Array:
    """x [R, V] f32 / bf16 / f16 sorted descending along V (same dtype), through integer keys
    of the same width in float order: an integer sort has a plain comparator, which XLA:GPU
    hands to CUB's radix sort at large sizes (run 12, H200: [128, 49152] f32 288 vs 495 µs for
    `-jnp.sort(-x)`, whose NaN-canonicalizing float comparator it cannot; 5% faster at 8-32
    rows). Same values, but -0.0 sorts below +0.0 (equal as floats, so the thresholds built
    from it are unchanged)."""
    int_type = _ORDER_KEY_TYPES[x.dtype.itemsize]
    keys = _float_order_keys(jax.lax.bitcast_convert_type(-x, int_type))
    return -jax.lax.bitcast_convert_type(_float_order_keys(jnp.sort(keys, axis=-1)), x.dtype)


_ORDER_KEY_TYPES = {4: jnp.int32, 2: jnp.int16}  # float width in bytes -> its order keys' type


def _float_order_keys(bits):
    """Float bit patterns (int32 / int16) <-> keys of the same type whose signed order is the
    floats' order (an involution: negative floats flip their magnitude bits)."""
    sign_bit = jnp.iinfo(bits.dtype).bits - 1
    return bits ^ ((bits >> sign_bit) & jnp.iinfo(bits.dtype).max)


def _topk_topp_threshold(sorted_desc, top_k, top_p):
    """Threshold [R, 1] from the C largest scaled logits per row (sorted_desc [R, C]),
    enough when every filtering row keeps at most C tokens, or C = V."""
    num = sorted_desc.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, num), num)[:, None]  # [R, 1] tokens kept by top-k
    # Top-k survivors: every token >= the k-th value, so ties with it too, and top-p renormalises
    # over all of them (as HF's TopK / TopP warpers and vLLM do), not over the first k sorted
    # (a tie-dependent subset: common in 16-bit logits). Ties past C columns (C < V) stay out.
    survivors = sorted_desc >= jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    vals = jnp.where(survivors, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(vals, axis=-1)  # renormalised over the top-k survivors
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix sum
    # Keep the smallest prefix whose mass reaches top_p: token i stays iff the mass before it
    # is < top_p (the first always stays). top_p >= 1 is off: no rounding can drop the tail.
    keep = survivors & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    thr = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
    # Rows that filter nothing (and padded / C < V rows with top-k off) keep everything.
    off = (top_k <= 0)[:, None] & (top_p >= 1.0)[:, None]
    return jnp.where(off, -jnp.inf, thr)
