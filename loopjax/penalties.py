"""Logits processing that needs a request's history, on device: repetition, frequency and
presence penalties and logit_bias (SamplingParams; vLLM's and OpenAI's meanings).

State: `TokenHistory` in DeviceState, one row per token slot (the engine's per-request slot,
as DeviceState.last_tokens): the output tokens' counts, the prompt's tokens, the bias. The
device keeps it because the host does not know the newest tokens (async scheduling: step n+1
is dispatched before step n is read).

Lifecycle of a slot's row (steps.py `_finish`):
- A request whose params process logits (`SamplingParams.processes_logits`) starts its row in
  the prefill step where it gets its token slot: its first token, or its first after a
  preemption. That batch's `HistoryReset` carries its prompt, the outputs it already has
  (a preempted request) and its bias.
- Every step with the full sampler adds each emitting row's token to its slot's counts. The
  greedy-only sampler (StepKind.greedy) neither reads nor counts, so the host never puts a
  row that processes logits in it.
- Rows that process nothing keep their logits bit for bit (their slot may hold another
  request's old history).

Semantics of one row, on f32 logits, in vLLM v1's order, after min_tokens' suppression:
  x = -inf outside allowed_token_ids (when given);  x += bias[token];
  tokens in the prompt or the output: x -> x / r if x > 0 else x * r;
  x -= f * count + p * (count > 0)  (count: times the token was output).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.sampling_params import MAX_LOGIT_BIAS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenHistory:
    """Per token slot (S = max rows + 1, the last for padding rows), V = vocabulary."""

    counts: jax.Array       # [S, V] i32  times each token was output
    prompt_seen: jax.Array  # [S, V] bool  the token is in the prompt
    bias: jax.Array         # [S, V] f32  logit_bias (0 elsewhere)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryReset:
    """Rows of a prefill step that start their slot's history (R rows, C = max context)."""

    row: jax.Array          # [R] bool  the row's token slot starts its history this step
    token_ids: jax.Array    # [R, C] i32  its prompt, then its outputs so far (-1: none)
    num_prompt: jax.Array   # [R] i32  how many of token_ids are prompt tokens
    bias_ids: jax.Array     # [R, MAX_LOGIT_BIAS] i32  logit_bias token ids (-1: none)
    bias_values: jax.Array  # [R, MAX_LOGIT_BIAS] f32
    restricted: jax.Array   # [R] bool  only the bias ids may be generated (allowed_token_ids)


def allocate(num_slots: int, vocab_size: int) -> TokenHistory:
    return TokenHistory(jnp.zeros((num_slots, vocab_size), jnp.int32),
                        jnp.zeros((num_slots, vocab_size), bool),
                        jnp.zeros((num_slots, vocab_size), jnp.float32))


def build_reset(histories: list, num_rows: int, context_len: int) -> HistoryReset:
    """Host (numpy) HistoryReset: histories[i] is None or row i's (prompt ids, output ids,
    logit_bias pairs, allowed_token_ids or None); rows past len(histories) are padding. An
    allowed set becomes the row's bias ids (each with its logit_bias, else 0), the rest -inf."""
    row = np.zeros(num_rows, bool)
    token_ids = np.full((num_rows, context_len), -1, np.int32)
    num_prompt = np.zeros(num_rows, np.int32)
    bias_ids = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    restricted = np.zeros(num_rows, bool)
    for i, history in enumerate(histories):
        if history is None:
            continue
        prompt, outputs, bias, allowed = history
        if allowed is not None:
            restricted[i], given = True, dict(bias)
            bias = [(t, given.get(t, 0.0)) for t in allowed]
        if len(prompt) + len(outputs) > context_len:
            raise ValueError(f"row {i}: {len(prompt) + len(outputs)} tokens of history exceed the "
                             f"context of {context_len}")
        row[i], num_prompt[i] = True, len(prompt)
        token_ids[i, :len(prompt) + len(outputs)] = list(prompt) + list(outputs)
        if bias:
            bias_ids[i, :len(bias)], bias_values[i, :len(bias)] = zip(*bias)
    return HistoryReset(row, token_ids, num_prompt, bias_ids, bias_values, restricted)


def reset(history: TokenHistory, slots, start: HistoryReset) -> TokenHistory:
    """The rows `start.row` of slots [R] rewritten from `start`; the other rows' slots
    untouched (they write the spare last slot, which no real row reads)."""
    spare, vocab = history.counts.shape[0] - 1, history.counts.shape[1]
    slots = jnp.where(start.row, slots, spare)
    base = jnp.where(start.restricted, -jnp.inf, 0.0)[:, None]  # a restricted row allows its bias ids only
    counts, seen, bias = (history.counts.at[slots].set(0), history.prompt_seen.at[slots].set(False),
                          history.bias.at[slots].set(jnp.broadcast_to(base, (len(slots), vocab))))
    ids = start.token_ids
    is_output = jnp.arange(ids.shape[1])[None, :] >= start.num_prompt[:, None]
    rows = jnp.broadcast_to(slots[:, None], ids.shape)
    dropped = lambda keep, x: jnp.where(keep & (x >= 0), x, vocab)  # noqa: E731  out of range: dropped
    counts = counts.at[rows, dropped(is_output, ids)].add(1, mode="drop")
    seen = seen.at[rows, dropped(~is_output, ids)].set(True, mode="drop")
    bias_rows = jnp.broadcast_to(slots[:, None], start.bias_ids.shape)
    bias = bias.at[bias_rows, dropped(True, start.bias_ids)].set(start.bias_values, mode="drop")
    return TokenHistory(counts, seen, bias)


def rows_of(history: TokenHistory, slots) -> TokenHistory:
    """The [R, V] rows of slots [R]."""
    return jax.tree.map(lambda a: a[slots], history)


def apply(scores, rows: TokenHistory, *, repetition, frequency, presence, processed):
    """scores [R, V] f32 after the rows' penalties and bias (module docstring); rows where
    processed [R] is False come back unchanged. repetition, frequency, presence: [R] f32."""
    x = scores + rows.bias
    output_seen = rows.counts > 0
    r = jnp.where(output_seen | rows.prompt_seen, repetition[:, None], 1.0)
    x = jnp.where(x > 0, x / r, x * r)
    x = x - frequency[:, None] * rows.counts.astype(jnp.float32) - presence[:, None] * output_seen
    return jnp.where(processed[:, None], x, scores)


def record(history: TokenHistory, slots, tokens) -> TokenHistory:
    """Each token [R] counted once more in its slot [R] (non-emitting rows: the spare slot)."""
    return dataclasses.replace(history, counts=history.counts.at[slots, tokens].add(1))
