"""On-device sampling: pure, jit-friendly functions over static shapes.

The runner builds a `SamplingBatch` on the host (`SamplingBatch.from_params`, numpy, one row
per decode row, padded to the row bucket R) and calls `sample` inside its jitted step; the
only values read back are the sampled tokens (and logprobs when asked).

Semantics of one row, in order (Hugging Face's warper order):
  temperature -> top-k -> top-p (over the top-k survivors, renormalised) -> min-p -> draw.
- Greedy rows (temperature < GREEDY_EPS) take the argmax of the raw logits, first index
  on ties (like torch); the whole batch shares one argmax.
- A token tied with the top-k / top-p boundary value is kept too (the mask is a value
  threshold), so the kept set never depends on the sort's tie order.
- min-p keeps tokens whose probability is >= min_p times the row's largest; since top-k and
  top-p always keep the largest, it is applied as a threshold on the scaled logits.
- The draw is argmax(masked logits + Gumbel noise) with the row's key
  `fold_in(key(seed), token_index)`: it depends only on the request's seed and the index
  of the token being generated (0 = first output token), never on the batch.
- Logprobs are those of the model's distribution: log_softmax(raw logits) at the chosen
  token, plus the `num_top_logprobs` largest (ids, values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.sampling_params import GREEDY_EPS, SamplingParams

# Rows whose top_k is in 1..TOP_K_CAP are filtered from the TOP_K_CAP largest values only
# (top-p over the top-k survivors needs only them).
TOP_K_CAP = 128


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

    @classmethod
    def from_params(cls, params_list: Sequence[SamplingParams], num_rows: int,
                    step_counts: Sequence[int]) -> SamplingBatch:
        """Host-side (numpy) batch: row i gets params_list[i], generating its token
        number step_counts[i]; rows past len(params_list) up to num_rows are padding."""
        n = len(params_list)
        if num_rows < n:
            raise ValueError(f"num_rows must be >= len(params_list) = {n}, got {num_rows}")
        if len(step_counts) != n:
            raise ValueError(f"step_counts must have one entry per params ({n}), got {len(step_counts)}")
        # NOTE: one conversion per dtype, no numpy call per row (host time of every step)
        floats = np.zeros((3, num_rows), np.float32)
        floats[1] = 1.0  # top_p off
        floats[:, :n] = [[p.temperature for p in params_list], [p.top_p for p in params_list],
                         [p.min_p for p in params_list]]
        ints = np.zeros((2, num_rows), np.int32)
        ints[:, :n] = [[p.top_k for p in params_list], list(step_counts)]
        seed = np.zeros((num_rows, 2), np.uint32)
        if n:  # negative seeds wrap, as a 64-bit two's complement
            seed[:n] = [((s := p.seed % 2**64) >> 32, s & 0xFFFFFFFF) for p in params_list]
        (temperature, top_p, min_p), (top_k, token_index) = floats, ints
        return cls(temperature, top_k, top_p, min_p, seed, token_index)


def row_keys(batch: SamplingBatch) -> jax.Array:
    """Typed threefry keys [R]: fold_in(key(seed), token_index); equals
    `jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), t)` for 0 <= seed < 2**31."""
    keys = jax.random.wrap_key_data(batch.seed, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, batch.token_index)


def sample(logits: jax.Array, batch: SamplingBatch, *, num_top_logprobs: int):
    """Sample one token per row.

    logits: [R, V] f32 (raw model logits); num_top_logprobs: static k >= 0.
    Returns tokens [R] i32, logprobs [R] f32 (chosen token), top_ids [R, k] i32,
    top_logprobs [R, k] f32 (descending).
    """
    if not 0 <= num_top_logprobs <= logits.shape[-1]:
        raise ValueError(f"num_top_logprobs must be in [0, {logits.shape[-1]}], got {num_top_logprobs}")
    logits = logits.astype(jnp.float32)
    with jax.named_scope("sample"):
        greedy = batch.temperature < GREEDY_EPS
        greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        # NOTE: branch-free: the draw (noise for R x V and the filters) runs even when every
        # row is greedy. A lax.cond / lax.switch on a device value makes XLA:GPU read it back
        # to the host in the middle of the step (a sync the engine avoids): measured in run 15,
        # a cond skipping the draw on all-greedy batches made the 32-row Ouro-1.4B step 2.6%
        # faster back to back, the 1-row step 28% slower, and burst-32 no faster.
        tokens = jnp.where(greedy, greedy_tokens, _draw(logits, batch, greedy))
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
        if num_top_logprobs > 0:
            top_vals, top_ids = jax.lax.top_k(logits, num_top_logprobs)
            top_logprobs = top_vals - lse[:, None]
        else:
            top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
            top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_logprobs


def _draw(logits, batch, greedy):
    """Tokens [R] i32 drawn from the filtered, temperature-scaled distribution."""
    vocab = logits.shape[-1]
    temperature = jnp.where(greedy, 1.0, batch.temperature)
    scaled = logits / temperature[:, None]
    masked = jnp.where(scaled >= filter_threshold(scaled, batch, greedy), scaled, -jnp.inf)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(row_keys(batch))
    return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)


def filter_threshold(scaled: jax.Array, batch: SamplingBatch, greedy: jax.Array) -> jax.Array:
    """Per-row value threshold [R, 1]: a token is kept iff its scaled logit >= it.

    Combines top-k, top-p and min-p. The exact path a batch needs is one of: 0) no sampled
    row uses top-k / top-p: min-p only; 1) every filtering row has top_k in 1..TOP_K_CAP: from
    the TOP_K_CAP largest values (what `lax.top_k` returns); 2) otherwise from the full
    descending sort. Branch-free (see `sample`): one sort of every row per step feeds paths 1
    and 2 (its first TOP_K_CAP columns are the top-k values) and the batch's path is selected.
    On the H200 the sort of [128, 65536] f32 costs ~0.4 ms (`sort_descending`; `lax.top_k` of
    128 as much as the float-comparator sort, ~0.6 ms).
    """
    vocab = scaled.shape[-1]
    top_k = jnp.where((batch.top_k <= 0) | (batch.top_k >= vocab), 0, batch.top_k)
    top_p_on = batch.top_p < 1.0
    filtering = ~greedy & ((top_k > 0) | top_p_on)
    capped = (top_k > 0) & (top_k <= TOP_K_CAP)
    cap = min(TOP_K_CAP, vocab)
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    sorted_desc = sort_descending(scaled)
    from_top_k = _topk_topp_threshold(sorted_desc[:, :cap], top_k, batch.top_p)
    from_sort = _topk_topp_threshold(sorted_desc, top_k, batch.top_p)
    thr = jnp.where(~jnp.any(filtering), -jnp.inf,
                    jnp.where(jnp.all(~filtering | capped), from_top_k, from_sort))
    # min-p: p_i >= min_p * p_max  <=>  scaled_i >= max + log(min_p); log(0) = -inf keeps all.
    min_p_thr = row_max + jnp.log(batch.min_p)[:, None]
    return jnp.maximum(thr, min_p_thr)


def sort_descending(x: jax.Array) -> jax.Array:
    """x [R, V] f32 sorted descending along V, through int32 keys in float order: an integer
    sort has a plain comparator, which XLA:GPU hands to CUB's radix sort at large sizes (run 12,
    H200: [128, 49152] 288 vs 495 µs for `-jnp.sort(-x)`, whose NaN-canonicalizing float
    comparator it cannot; 5% faster at 8-32 rows). Same values, but -0.0 sorts below +0.0
    (equal as floats, so the thresholds built from it are unchanged)."""
    keys = _float_order_keys(jax.lax.bitcast_convert_type(-x, jnp.int32))
    return -jax.lax.bitcast_convert_type(_float_order_keys(jnp.sort(keys, axis=-1)), jnp.float32)


def _float_order_keys(bits):
    """f32 bit patterns <-> int32 keys whose signed order is the floats' order (an
    involution: negative floats flip their magnitude bits)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _topk_topp_threshold(sorted_desc, top_k, top_p):
    """Threshold [R, 1] from the C largest scaled logits per row (sorted_desc [R, C]),
    enough when every filtering row keeps at most C tokens, or C = V."""
    num = sorted_desc.shape[-1]
    idx = jnp.arange(num)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, num), num)[:, None]  # [R, 1] tokens kept by top-k
    vals = jnp.where(idx < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(vals, axis=-1)  # renormalised over the top-k survivors
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix sum
    # Keep the smallest prefix whose mass reaches top_p: token i stays iff the mass before it
    # is < top_p (the first always stays). top_p >= 1 is off: no rounding can drop the tail.
    keep = (idx < k) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    thr = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
    # Rows that filter nothing (and padded / C < V rows with top-k off) keep everything.
    off = (top_k <= 0)[:, None] & (top_p >= 1.0)[:, None]
    return jnp.where(off, -jnp.inf, thr)
