"""The engine's per-request data the scheduler does not keep (`RequestExtra`: Huginn's s0 rule,
exit settings, bad_words' token sequences, device slots, text and logprobs so far), made from
what `Engine.add_request` was given, what a request's KV depends on besides its tokens and
loops (`cache_salt`), its text after each of its tokens (`update_text`: stop strings) and
its `RequestOutput` (`request_output`, with vLLM's `stop_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loopjax import bad_words
from loopjax.batch import INIT_EXPLICIT, INIT_SEEDED, INIT_ZERO
from loopjax.detokenizer import IncrementalDetokenizer, decode_output, prompt_context
from loopjax.exits import ExitSpec
from loopjax.request import FINISH_ABORT, FINISH_STOP, RequestOutput, Snapshot
from loopjax.sampling_params import listed_rank
from loopjax.wording import counted


@dataclass
class RequestExtra:
    """Engine-side per-request data the scheduler does not keep."""

    init_mode: int = INIT_SEEDED
    init_states: np.ndarray | None = None   # [positions, H] explicit Huginn s0
    skip: bool = False                      # adaptive "skip": stop at the exit (or trace)
    exit_spec: ExitSpec | None = None       # Huginn exit criterion
    bad_words: tuple = ()                   # its bad_words' token-id sequences (bad_words.py)
    warm: bool = False                      # Huginn warm start (keeps a carry slot throughout)
    carry_slot: int | None = None
    token_slot: int | None = None           # its last sampled token on the device
    text: str | None = None
    detokenizer: IncrementalDetokenizer | None = None  # requests with stop strings
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # of each token asking logprobs (listed_rank)


def request_extra(model, params, initial_state, default_init: str, num_positions: int,
                  warm_start: bool) -> RequestExtra:
    """A new request's RequestExtra: its s0 rule (`initial_state_extra`), warm start, exit
    settings and its bad_words' token sequences; one-line ValueErrors."""
    extra = initial_state_extra(model.cfg, initial_state, default_init, num_positions)
    extra.warm = bool(warm_start)
    extra.skip = params.exit_mode == "skip" or params.exit_trace is not None
    extra.bad_words = bad_words.request_sequences(model, params.bad_words)
    if params.exit_criterion is not None:
        threshold = "auto" if params.exit_threshold is None else params.exit_threshold
        extra.exit_spec = ExitSpec(params.exit_criterion, threshold, params.exit_min_loops,
                                   params.exit_check_every)
    return extra


def check_state_truncation(initial_state, num_given: int, num_kept: int) -> None:
    """Explicit Huginn states give one s0 per position of the prompt as given: a prompt that
    truncate_prompt_tokens cut to its tail would pair them with other positions (they applied
    from its first kept token on); a one-line ValueError."""
    if num_kept < num_given and initial_state is not None and not isinstance(initial_state, str):
        raise ValueError(f"truncate_prompt_tokens cut the prompt from {num_given} to "
                         f"{counted(num_kept, 'token')}, and initial_state gives states by position: give "
                         "the kept prompt and its states")


def initial_state_extra(cfg, spec, default: str, num_positions: int) -> RequestExtra:
    """A request's RequestExtra with its Huginn s0 rule: `spec` None (the engine's `default`,
    EngineConfig.huginn_init), 'seeded', 'zero' or explicit states [>= num_positions, H];
    Ouro takes none (a one-line ValueError otherwise)."""
    if cfg.family != "huginn":
        if spec is not None:
            raise ValueError("initial_state applies to Huginn models only")
        return RequestExtra()
    spec = default if spec is None else spec
    if isinstance(spec, str):
        modes = {"seeded": INIT_SEEDED, "zero": INIT_ZERO}
        if spec not in modes:
            raise ValueError(f"initial_state must be 'seeded', 'zero' or an array, got {spec!r}")
        return RequestExtra(init_mode=modes[spec])
    hidden = cfg.hidden_size
    try:
        states = np.asarray(spec, np.float32)
    except (TypeError, ValueError):  # NOTE: numpy's words (a dict, ragged rows) would not name the field
        raise ValueError(f"initial_state must be 'seeded', 'zero' or an array [positions, {hidden}] of "
                         f"numbers, got {type(spec).__name__}") from None
    fed = "one s0 per position fed: prompt + max_tokens - 1, up to the context"
    # NOTE: apart, since loopjax.generate checks the shape before its engine knows the count
    if states.ndim != 2 or states.shape[1] != hidden:
        raise ValueError(f"initial_state must be an array [positions, {hidden}] ({fed}), got shape "
                         f"{states.shape}")
    if states.shape[0] < num_positions:
        raise ValueError(f"initial_state must have shape [>= {num_positions}, {hidden}] ({fed}), got "
                         f"{states.shape}")
    return RequestExtra(init_mode=INIT_EXPLICIT, init_states=states)


def cache_salt(extra: RequestExtra, cfg, huginn_seed: int, user_salt: str | None = None) -> tuple | None:
    """What a request's KV depends on besides tokens and loops (prefix_cache.py): nothing for
    Ouro; Huginn's s0 rule, and None (never share) for explicit states; and the request's own
    `user_salt` (vLLM's cache_salt: requests of other salts, or none, never share its pages)."""
    if cfg.family == "huginn" and extra.init_mode == INIT_EXPLICIT:
        return None
    model = (() if cfg.family != "huginn" else ("zero",) if extra.init_mode == INIT_ZERO
             else ("seeded", huginn_seed))
    return model if user_salt is None else (*model, ("salt", user_salt))


def record_logprobs(extra: RequestExtra, k: int, token: int, result, i: int) -> None:
    """Row i of a step's result (batch.StepResult) for its sampled `token`: its log-prob, the
    top k and its rank (vLLM's, as listed beside them)."""
    extra.logprobs.append(float(result.logprobs[i]))
    top = [(int(t), float(v)) for t, v in zip(result.top_ids[i][:k], result.top_logprobs[i][:k])]
    extra.top_logprobs.append(top)
    extra.ranks.append(listed_rank(token, int(result.ranks[i]), top))


def update_text(extra: RequestExtra, request, model) -> bool:
    """After a request's new token: apply its stop strings (new tokens decoded incrementally,
    as is the text without spaces_between_special_tokens) and set the text of a finished one
    (else decoded once). True when a stop string ends the running request now (the engine
    finishes it). Nothing for detokenize=False (the server decodes as it streams).
    Either way the output is decoded after its prompt's tail and an aborted request's text
    ends at its last whole character (detokenizer.py)."""
    params = request.sampling_params
    if not params.detokenize:
        return False
    # NOTE: a stop token (EOS, a stop id) ending the output adds no text, as in vLLM (unless
    # include_stop_str_in_output)
    stop_token = (request.is_finished and request.finish_reason == FINISH_STOP
                  and not params.include_stop_str_in_output)
    complete = request.is_finished and request.finish_reason != FINISH_ABORT
    stops_now = False
    if params.stop or not params.spaces_between_special_tokens:
        if extra.detokenizer is None:
            extra.detokenizer = IncrementalDetokenizer.for_output(model.tokenizer, params,
                                                                  request.prompt_token_ids)
        # NOTE: the last token (max_tokens) is searched too: a stop string there trims the text
        # and makes the reason "stop" (as vLLM's and the server's Choice).
        if extra.detokenizer.update(request.output_token_ids, final=complete, stop_token=stop_token):
            if request.is_finished:
                request.finish_reason = FINISH_STOP
            else:
                stops_now = True
        extra.text = extra.detokenizer.text
    if request.is_finished and extra.detokenizer is None:
        ids = request.output_token_ids
        extra.text = decode_output(model.tokenizer, ids[:len(ids) - stop_token],
                                   prompt_context(model.tokenizer, request.prompt_token_ids),
                                   params.skip_special_tokens, complete)
    return stops_now


def stop_reason(request, extra: RequestExtra, primary_eos: tuple[int, ...]) -> int | str | None:
    """vLLM's stop_reason of a request finished with 'stop': its stop string, else its last token
    unless that is the primary EOS (the tokenizer's; vLLM checks it before the stop ids and
    gives None) with ignore_eos off: generation_config.json's other EOS ids join the stop ids
    there, so they are given as stop_reason like any stop id. None for other finishes."""
    if request.finish_reason != FINISH_STOP:
        return None
    if extra.detokenizer is not None and extra.detokenizer.stop_string is not None:
        return extra.detokenizer.stop_string
    last = request.output_token_ids[-1]
    return None if last in primary_eos and not request.sampling_params.ignore_eos else last


def request_output(request, extra: RequestExtra, new_tokens, model,
                   primary_eos: tuple[int, ...]) -> RequestOutput:
    """The RequestOutput of a request that got `new_tokens` or finished (an aborted one gets the
    text of the tokens it got); `stop_reason`'s primary_eos."""
    if request.is_finished and extra.text is None and model.tokenizer is not None:
        update_text(extra, request, model)
    want_lp = request.sampling_params.logprobs is not None
    subs = request.num_prefill_submissions + request.num_decode_submissions
    metrics = {"ttft": request.ttft, "tpot": request.tpot, "num_submissions": subs,
               "submissions_per_token": subs / max(1, request.num_output_tokens),
               "decode_submissions_per_token": request.decode_submissions_per_token,
               "num_preemptions": request.num_preemptions}
    return RequestOutput(request.request_id, list(new_tokens), Snapshot(request.output_token_ids),
                         request.is_finished, request.finish_reason, Snapshot(request.exit_loops),
                         extra.text, Snapshot(extra.logprobs) if want_lp else None,
                         Snapshot(extra.top_logprobs) if want_lp else None, metrics,
                         stop_reason(request, extra, primary_eos), Snapshot(extra.ranks) if want_lp else None)
