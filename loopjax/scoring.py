"""Log-likelihood scoring on the identity path: `loopjax.score(model, sequences)`.

For a sequence x of T >= 1 tokens: log p(x_t | x_<t) for t = 1..T-1 from `loopjax.forward`'s
exit-selected logits (the reference's numbers), and whether x_t is the greedy choice there.
Summed over a continuation's slice, that is lm-eval's `loglikelihood(context, continuation)`.

Each sequence runs alone, right-padded to a power of two (at least MIN_BUCKET tokens, at most
the model's context) so that sequences of similar length share one compiled forward: attention
is causal and Huginn's initial state is keyed by position, so padding changes no real position
beyond the rounding of products over more rows (tests/test_scoring.py: within 1e-5 of the
unpadded forward). The log-softmax runs on the device; only [T-1] numbers come back.

`score_options` gives the `score` settings that see a prompt as an engine request runs it
(its depth, Ouro exit rule and Huginn s_0); the server's `echo` and `LLM.generate`'s
`prompt_logprobs` both use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.request import holds_bools
from loopjax.sampling import top_k as top_k_of  # the sampler's top-k (two stages above k = 16)

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    token_ids: list[int]  # [T] the scored sequence
    token_logprobs: list[float]  # [T - 1]: log p(x_t | x_<t), t = 1..T-1
    greedy: list[bool]  # [T - 1]: x_t is the argmax of the logits it follows
    top_logprobs: list[list[tuple[int, float]]]  # [T - 1][top_k]: (id, log p), most likely first
    # [T - 1]: the number of tokens whose log p is >= x_t's, x_t included (vLLM's rank: a tie ranks
    # it last; 1 when x_t is the only argmax)
    ranks: list[int]

    def logprob(self, start: int, end: int | None = None) -> float:
        """The sum of log p(x_t | x_<t) over tokens start..end-1 (start >= 1): a continuation
        x[start:end] given the context x[:start], `end` as in that slice (None: to the last
        token; negative: counted from the end; at or before start: nothing, 0.0)."""
        if start < 1:
            raise ValueError(f"start must be >= 1 (the first token has no prefix), got {start}")
        # NOTE: token t's log p is token_logprobs[t - 1]: resolve `end` on the tokens first (a
        # negative end shifted by one would drop a token; end=0 would become -1, not empty)
        stop = max(slice(start, end).indices(len(self.token_ids))[1], start)
        return float(sum(self.token_logprobs[start - 1:stop - 1]))


def bucket_len(length: int, max_len: int) -> int:
    """The padded length of a `length`-token sequence: a power of two >= MIN_BUCKET, <= max_len."""
    if length > max_len:
        raise ValueError(f"a sequence of {length} tokens exceeds the model's context of {max_len}")
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_len)


@partial(jax.jit, static_argnames="top_k")
def _next_token_logprobs(logits, ids, top_k: int):
    """logits [P, V] f32 at positions 0..P-1, ids [P] -> log p(ids[t + 1]) [P-1], greedy [P-1],
    rank [P-1] (the log-probs >= ids[t + 1]'s, its own included: vLLM's rule, as the sampler's),
    and the top_k (log p [P-1, k], ids [P-1, k]) of each position."""
    log_probs = jax.nn.log_softmax(logits[:-1], axis=-1)
    nxt = ids[1:]
    chosen = jnp.take_along_axis(log_probs, nxt[:, None], axis=-1)[:, 0]
    # NOTE: ranked on the log-probs, as vLLM ranks them (the shift may round close logits to one)
    rank = jnp.sum(log_probs >= chosen[:, None], axis=-1, dtype=jnp.int32)
    return chosen, jnp.argmax(logits[:-1], axis=-1) == nxt, rank, top_k_of(log_probs, top_k)


def score(model, sequences, *, loops: int | None = None, exit_threshold: float | None = None,
          initial_state: str | None = None, top_k: int = 0, exit_step: int | None = None,
          exit_weighted: bool = False) -> list[ScoreOutput]:
    """Score `sequences` (token-id lists or texts, or one of them) with `model` (a Model, or what
    `loopjax.load` takes: a folder, a cached Hub name, a preset name); one ScoreOutput per
    sequence, in order. `loops`, Ouro's exit rule (`exit_threshold`, `exit_step`, `exit_weighted`:
    the reference's training loss scores the weighted logits) and `initial_state` (Huginn: None
    for the position-keyed s_0, or 'zero'; an explicit s_0 goes through `loopjax.forward`) as in
    `loopjax.forward`; `top_k` most likely tokens of each position in `top_logprobs` (0: none)."""
    from loopjax.model import _check_ids, forward, load
    from loopjax.models import huginn

    model = load(model) if isinstance(model, str | os.PathLike) else model  # a folder as LLM takes it
    if (isinstance(top_k, bool) or not isinstance(top_k, int | np.integer)
            or not 0 <= top_k <= model.cfg.vocab_size):  # numpy integers too, as `loops` takes them
        raise ValueError(f"top_k must be an integer in [0, {model.cfg.vocab_size}], got {top_k!r}")
    top_k = int(top_k)
    if isinstance(initial_state, str) and initial_state != "zero":
        raise ValueError(f"initial_state must be None (the position-keyed s_0) or 'zero' when scoring, "
                         f"got {initial_state!r}")
    if initial_state is not None and not isinstance(initial_state, str):
        raise ValueError(f"initial_state must be None or 'zero' when scoring, got a "
                         f"{type(initial_state).__name__} (an explicit s_0 [T, H]: use loopjax.forward)")
    if isinstance(sequences, str) or getattr(sequences, "ndim", None) == 1:  # numpy's or jax's array
        items: Sequence = [sequences]
    else:
        items = list(sequences)
        if items and isinstance(items[0], int | np.integer):  # one sequence of token ids
            items = [items]
    if not items:
        raise ValueError("sequences is empty")
    outputs = []
    for i, seq in enumerate(items):
        ids = model.tokenize(seq) if isinstance(seq, str) else np.asarray(seq)
        # NOTE: refused as the engine's check_prompt_ids does, not cast: int() would score 3.7 as 3
        if not isinstance(ids, list) and ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu"
                                                       or holds_bools(seq)):
            raise ValueError(f"sequence {i} must be text or a flat list of integer token ids")
        ids = [int(t) for t in ids]
        if not ids:  # one token has nothing to score (its lists are empty), none is an error
            raise ValueError(f"sequence {i} is empty")
        padded = ids + [0] * (bucket_len(len(ids), model.cfg.max_context_len) - len(ids))
        if model.family == "huginn":  # the final logits only: no per-loop coda and head
            rule = (("exit_threshold", exit_threshold is not None), ("exit_step", exit_step is not None),
                    ("exit_weighted", exit_weighted))
            if given := next((name for name, on in rule if on), None):
                raise ValueError(f"{given} is an Ouro argument: Huginn has no exit gate")
            out = huginn.forward(model.params, model.cfg, _check_ids(padded, model.cfg.vocab_size),
                                 loops=loops, initial_state=initial_state, per_loop_logits=False)
        else:
            out = forward(model, padded, loops=loops, exit_threshold=exit_threshold,
                          initial_state=initial_state, exit_step=exit_step, exit_weighted=exit_weighted)
        logprobs, greedy, ranks, (top_lp, top_ids) = _next_token_logprobs(
            out.logits, jnp.asarray(padded, jnp.int32), top_k)
        n = len(ids) - 1
        tops = [list(zip(i, lp, strict=True)) for i, lp in zip(np.asarray(top_ids[:n]).tolist(),
                                                               np.asarray(top_lp[:n]).tolist(), strict=True)]
        outputs.append(ScoreOutput(ids, np.asarray(logprobs[:n]).tolist(), np.asarray(greedy[:n]).tolist(),
                                   tops, np.asarray(ranks[:n]).tolist()))
    return outputs


def score_state(model, engine_config=None, initial_state=None) -> str | None:
    """The `initial_state` under which `score` sees a prompt as an engine of `engine_config`
    (an EngineConfig; None: the defaults) runs it, given the request's `initial_state`
    (Huginn: None for the engine's default, 'seeded' or 'zero'): None (Ouro; Huginn's
    position-keyed s_0 of seed 0) or 'zero'. A one-line ValueError where `score` cannot
    follow: a model without weights, an explicit s_0, a position-keyed s_0 of another seed."""
    if not hasattr(model, "params") or getattr(model, "family", None) not in ("ouro", "huginn"):
        raise ValueError("prompts cannot be scored without an Ouro or Huginn model's weights")
    if model.family == "ouro":
        if initial_state is not None:
            raise ValueError("initial_state applies to Huginn models only")
        return None
    if initial_state is not None and not isinstance(initial_state, str):
        raise ValueError(f"an explicit initial_state (a {type(initial_state).__name__}) cannot be "
                         f"scored: scoring takes the engine's 'seeded' or 'zero' s_0")
    spec = getattr(engine_config, "huginn_init", "seeded") if initial_state is None else initial_state
    if spec == "zero":
        return "zero"
    if spec != "seeded":
        raise ValueError(f"initial_state must be 'seeded', 'zero' or an array, got {spec!r}")
    seed = getattr(engine_config, "huginn_seed", 0)
    if seed != 0:
        raise ValueError(f"scoring keys the position-keyed s_0 by seed 0; this engine's "
                         f"huginn_seed is {seed}")
    return None


def score_options(model, params, *, num_loops: int | None = None, engine_config=None,
                  initial_state=None) -> dict:
    """`score`'s loops, exit rule and initial_state for a prompt that `params` (a
    SamplingParams) generates from on an engine of `engine_config` whose default depth is
    `num_loops` (None: the model's): the request's depth, else num_loops; Ouro's exit_threshold
    as the request sets it (None: the config's rule, as the engine), its exit_step or
    exit_weighted where set; `score_state`'s s_0. The identity path computes every prompt
    position at a fixed depth or with Ouro's gate rules: a Huginn exit_criterion or an
    exit_trace is a one-line ValueError. exit_mode 'skip' scores as 'select': the engine runs
    every loop of an Ouro prompt token (a Huginn one without an exit_criterion runs its depth),
    and a position's exit loop gives the same logits whether later loops run or not."""
    if params.exit_criterion is not None or params.exit_trace is not None:
        raise ValueError(f"prompts are scored at a fixed depth or with Ouro's exit gate; "
                         f"{params.exit_rule} is not supported with it")
    state = score_state(model, engine_config, initial_state)
    ouro_rule = {}  # NOTE: only where set (Huginn refuses them; the options key each scoring)
    if params.exit_step is not None:
        ouro_rule["exit_step"] = params.exit_step
    if params.exit_weighted:
        ouro_rule["exit_weighted"] = True
    return {"loops": params.loops if params.loops is not None else num_loops,
            "exit_threshold": params.exit_threshold if model.family == "ouro" else None,
            "initial_state": state, **ouro_rule}
