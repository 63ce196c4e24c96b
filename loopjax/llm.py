"""Offline generation: `LLM` (keeps one compiled engine across calls) and `generate`.

Prompts are strings (when the model has a tokenizer), token-id lists, or vLLM's prompt dicts
({"prompt": text}, {"prompt_token_ids": ids}); `SamplingParams.n` samples each (`fan_out`:
sample i uses seed + i; params without a seed draw one per prompt and call, so one params
object for many prompts gives independent samples). Each result holds the generated tokens
only (`token_ids`, as vLLM does), `text`, `exit_loops` (loops of the selected state per
token), `finish_reason`, `stop_reason` (vLLM's), the log-probabilities asked for and metrics
(ttft, tpot, num_submissions, submissions_per_token).

Huginn `initial_state`: None (the engine default: position-keyed random s0), 'zero',
'seeded', or explicit s0 per position [prompt + max_tokens - 1, H] (an array or nested lists;
the goldens' `gen_init_states`). A call of ONE prompt (a string or one id sequence) takes it
as that prompt's; a call of a list of prompts takes None or a mode for all of them, or a list
(or tuple) with one entry per prompt: an array there is refused (is it one state or one per
prompt?), as is a list of the wrong length. `warm_start=True` starts each generated token
from ln_f of the previous token's final state. Adaptive exits: the SamplingParams exit
fields (exit_mode, exit_threshold, exit_criterion, exit_trace) run on device.

`prompt_logprobs` (vLLM's): each distinct prompt a call asks it for is scored once on the
identity path (`loopjax.score`, after the generation, at the depth, Ouro exit rule and Huginn
s_0 the request runs with: `scoring.score_options`); its samples share the result.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import tqdm

from loopjax.chat import encode_chat
from loopjax.engine import Engine, EngineConfig
from loopjax.generate_output import GenerateOutput, generate_output
from loopjax.generation_defaults import sampling_defaults
from loopjax.request import check_exit_depth, check_prompt_ids
from loopjax.request_extra import check_state_truncation, initial_state_extra
from loopjax.sampling_params import (
    DEFAULT_MAX_N,
    SamplingParams,
    check_for_model,
    check_int,
    check_n,
    listed_rank,
)
from loopjax.scoring import score, score_options


class LLM:
    """`LLM(model_or_path, dtype=None, generation_config="auto", override_generation_config=None,
    **engine_options)`;
    `generate(prompts, params | kwargs)`; `chat(messages, params | kwargs)`.
    generation_config (vLLM's): "auto" takes the model's recommended sampling defaults
    (generation_config.json, `generation_defaults.py`) for what a call's kwargs leave unset;
    "vllm": none. override_generation_config (vLLM's): generation_config.json keys merged over
    those defaults, e.g. {"temperature": 0.5}."""

    def __init__(self, model_or_path, *, dtype=None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **engine_options: Any):
        self.model = _model(model_or_path, dtype)
        self.sampling_defaults = sampling_defaults(getattr(self.model, "generation_config", None),
                                                   generation_config, override_generation_config)
        self.engine = Engine(self.model, EngineConfig(**engine_options))

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of the model's sampling defaults (vLLM's: SamplingParams' own where none)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, initial_state=None, warm_start: bool = False, use_tqdm: bool = False,
                 **kwargs: Any) -> list[GenerateOutput]:
        """One GenerateOutput per prompt and sample, in order: each prompt's samples together,
        sample 0 first (with the same n for every prompt, prompt p's sample i is result
        p * n + i). initial_state: the prompt's (one prompt) or
        one per prompt (a list of prompts; None or a mode: all), module note. kwargs build a
        SamplingParams (`max_new_tokens` is an alias of `max_tokens`; what they leave out is the
        model's sampling default, `sampling_defaults` (vLLM's), else `temperature` 0.0, greedy, as
        in `loopjax.generate`, not SamplingParams' 1.0) when sampling_params is None. use_tqdm
        (vLLM's; off by default here): a progress bar of finished requests on stderr."""
        prompt_list, one_prompt = _prompt_list(prompts)
        states = _state_list(initial_state, len(prompt_list), one_prompt)
        ids = [_prompt_ids(self.model, p, k) for k, p in enumerate(prompt_list)]
        params = _params_list(sampling_params, kwargs, len(ids), self.sampling_defaults)
        kept = [p.truncate(prompt) for p, prompt in zip(params, ids)]  # as the engine cuts them
        for given, prompt, state in zip(ids, kept, states):
            check_state_truncation(state, len(given), len(prompt))
        ids = kept
        scoring = [self._score_options(p, s) for p, s in zip(params, states)]  # before any is queued
        jobs = [(k, i, sample) for k, p in enumerate(params) for i, sample in enumerate(p.fan_out())]
        order = []
        try:
            for k, i, sample in jobs:
                # NOTE: the id names the prompt in a refusal; a call's requests are all finished
                # when it returns (or raises), so the next call's ids are free again
                rid = f"prompt {k}" if params[k].n == 1 else f"prompt {k} sample {i}"
                order.append(self.engine.add_request(ids[k], sample, rid, initial_state=states[k],
                                                     warm_start=warm_start))
            finals = self._drain(len(jobs) if use_tqdm else None)
        except BaseException:  # a refused prompt, or an interrupt (Ctrl-C) while generating
            for rid in order:  # all or nothing: nothing of this call stays queued or running
                self.engine.abort(rid)
            self._drain()
            raise
        prompt_lps = self._prompt_logprobs(ids, scoring)
        return [generate_output(ids[k], finals[rid], self.model, prompt_lps[k], sample)
                for (k, _, sample), rid in zip(jobs, order)]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             **generate_kwargs: Any) -> list[GenerateOutput]:
        """`generate` on conversations (vLLM's `LLM.chat`): `messages` is one conversation (a
        list of {role, content} dicts, content text or text parts) or a list of them. Each is
        rendered by `chat_template` (default: the checkpoint's; `chat_template_kwargs`: more of
        its variables; `continue_final_message`: the last message left open, as vLLM's;
        add_generation_prompt defaults to its opposite) and encoded without the
        tokenizer's special tokens (the template writes its own), as the server's chat is.
        The other arguments are `generate`'s; results are in its order, one conversation per
        prompt."""
        one = isinstance(messages, list | tuple) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, list | tuple) or not conversations:
            raise ValueError("messages must be a conversation (a list of {role, content} dicts) or a "
                             "non-empty list of them")
        if add_generation_prompt is None:  # NOTE: vLLM asks for it to be turned off by hand
            add_generation_prompt = not continue_final_message
        ids = []
        for k, conversation in enumerate(conversations):
            try:
                # NOTE: a tuple of messages is a conversation too (the server's JSON gives lists)
                conversation = list(conversation) if isinstance(conversation, tuple) else conversation
                ids.append(encode_chat(self.model, conversation, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       template_kwargs=chat_template_kwargs,
                                       continue_final_message=continue_final_message))
            except ValueError as e:
                raise ValueError(str(e) if one else f"conversation {k}: {e}") from None
        # NOTE: one conversation is one prompt (an initial_state is its own, generate's rule)
        return self.generate(ids[0] if one else ids, sampling_params, **generate_kwargs)

    def _score_options(self, params: SamplingParams, state) -> dict | None:
        """`score`'s keywords (top_k included) for a request asking prompt_logprobs, else None;
        a one-line ValueError naming prompt_logprobs where the prompt cannot be scored."""
        if params.prompt_logprobs is None:
            return None
        if params.prompt_logprobs > self.model.cfg.vocab_size:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary of "
                             f"{self.model.cfg.vocab_size}")
        try:
            options = score_options(self.model, params, num_loops=self.engine.scheduler.config.num_loops,
                                    engine_config=self.engine.config, initial_state=state)
        except ValueError as e:
            raise ValueError(f"prompt_logprobs: {e}") from None
        return {**options, "top_k": params.prompt_logprobs}

    def _prompt_logprobs(self, ids: list[list[int]], scoring: list[dict | None]) -> list:
        """Per prompt: (GenerateOutput.prompt_logprobs, its prompt_ranks), or None; one `score`
        per distinct (prompt, settings)."""
        done: dict = {}
        results = []
        for prompt, options in zip(ids, scoring, strict=True):
            if options is None:
                results.append(None)
                continue
            key = (tuple(prompt), tuple(sorted(options.items())))
            if key not in done:
                out = score(self.model, [prompt], **options)[0]
                done[key] = ([None] + list(zip(out.token_logprobs, out.top_logprobs, strict=True)),
                             [None] + [listed_rank(t, r, top) for t, r, top in
                                       zip(prompt[1:], out.ranks, out.top_logprobs, strict=True)])
            results.append(done[key])
        return results

    def _drain(self, num_shown: int | None = None) -> dict:
        """Step until every request is finished -> {request id: final output}; with num_shown,
        a progress bar of that many requests."""
        finals = {}
        bar = None if num_shown is None else tqdm.tqdm(total=num_shown, desc="generate", unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return finals


def _prompt_ids(model, prompt, k: int) -> list[int]:
    """The token ids of prompt k of a call: text (encoded with the tokenizer's special tokens),
    token ids, or vLLM's prompt dicts {"prompt": text} and {"prompt_token_ids": ids}; a one-line
    ValueError naming the prompt otherwise (an empty text too), before anything is queued."""
    if isinstance(prompt, dict):
        if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
            raise ValueError(f"prompt {k}: a prompt dict holds one key, 'prompt' (text) or "
                             f"'prompt_token_ids', got {sorted(map(str, prompt))}")
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
    ids = model.tokenize(prompt) if isinstance(prompt, str) else prompt
    try:  # NOTE: a text's ids are checked too: an empty text has none
        return check_prompt_ids(ids, model.cfg.vocab_size)
    except ValueError as e:  # named as the engine's refusals name it
        raise ValueError(f"prompt {k}: {e}") from None


def _model(model_or_path, dtype=None):
    """A Model as given, or loaded from a folder (str or os.PathLike) or a preset name."""
    from loopjax import checkpoint
    from loopjax.model import Model, load

    if isinstance(model_or_path, str | os.PathLike):
        return load(model_or_path, dtype)
    if not isinstance(model_or_path, Model):
        raise ValueError(f"model must be a loopjax Model, a model folder or a preset name, "
                         f"got {type(model_or_path).__name__}")
    dtype = checkpoint.dtype_option(dtype)
    if dtype is not None and (want := checkpoint.parse_dtype(dtype)) != model_or_path.dtype:
        raise ValueError(f"dtype {want} differs from the given Model's {model_or_path.dtype}: dtype "
                         f"applies to a model loaded by name (loopjax.load(path, dtype))")
    return model_or_path


def _prompt_list(prompts) -> tuple[list, bool]:
    """(the prompts of a call, whether it is ONE prompt): a string, a prompt dict or one token-id
    sequence (ints, or a 1-D integer array: numpy's or jax's) is one prompt; otherwise each item
    is one (the rows of a 2-D array)."""
    if isinstance(prompts, str | dict) or getattr(prompts, "ndim", None) == 1:
        return [prompts], True
    if not hasattr(prompts, "__iter__") or isinstance(prompts, set | frozenset):  # NOTE: unordered
        raise ValueError(f"prompts must be a string, token ids or a list of them, "
                         f"got {type(prompts).__name__}")
    prompt_list = list(prompts)
    if prompt_list and isinstance(prompt_list[0], int | np.integer):
        return [prompt_list], True
    return prompt_list, False


def _state_list(initial_state, num_prompts: int, one_prompt: bool) -> list:
    """One Huginn initial_state per prompt (module note): a call of one prompt takes it whole;
    a list of prompts takes None or a mode for all, or a list (tuple) of one entry per prompt."""
    if one_prompt or initial_state is None or isinstance(initial_state, str):
        return [initial_state] * num_prompts
    if not isinstance(initial_state, list | tuple):
        raise ValueError(f"initial_state: one {type(initial_state).__name__} for a list of {num_prompts} "
                         f"prompts; give a list with one state per prompt")
    if len(initial_state) != num_prompts:
        raise ValueError(f"initial_state: {len(initial_state)} entries for {num_prompts} prompts "
                         f"(a list of prompts takes one state per prompt)")
    return list(initial_state)


def _params_list(sampling_params, kwargs, num_prompts: int, defaults: dict) -> list[SamplingParams]:
    """One SamplingParams per prompt; each whose seed was drawn (seed=None) gets a new draw:
    one params object often serves many prompts and calls, whose samples must not share
    their random draws (vLLM's unseeded requests are independent). A given seed is kept.
    kwargs take the model's sampling `defaults` (`LLM.sampling_defaults`) for what they leave out."""
    if sampling_params is not None:
        if kwargs:
            raise ValueError(f"give sampling_params or sampling keyword arguments, not both (got "
                             f"{', '.join(sorted(kwargs))} beside sampling_params)")
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * num_prompts
        if not isinstance(sampling_params, list | tuple):  # NOTE: a str has a len too
            raise ValueError(f"sampling_params must be SamplingParams or a list of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"{len(sampling_params)} sampling_params for {num_prompts} prompts")
    else:
        kwargs = dict(kwargs)
        if "max_new_tokens" in kwargs:
            new = _check_max_new_tokens(kwargs.pop("max_new_tokens"))
            if kwargs.setdefault("max_tokens", new) != new:  # NOTE: refused, not one of them dropped
                raise ValueError(f"max_tokens ({kwargs['max_tokens']!r}) and max_new_tokens ({new!r}) "
                                 f"disagree; give one")
        kwargs = {**defaults, **kwargs}
        kwargs.setdefault("temperature", 0.0)
        sampling_params = [SamplingParams(**kwargs)] * num_prompts
    for p in sampling_params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        check_n(p.n, DEFAULT_MAX_N, "LLM's")  # each sample is one engine request, as the server's
    return [dataclasses.replace(p, seed=None) if p.seed_drawn else p for p in sampling_params]


def _check_max_new_tokens(value):
    """max_new_tokens (None: up to the context), refused by its own name (SamplingParams' max_tokens)."""
    return value if value is None else check_int("max_new_tokens", value, 1) or value


_CACHE: dict = {}  # (model source, engine options) -> LLM: `generate` keeps one engine


def _source(model) -> tuple | None:
    """What names a model given by name (None for a Model object): a preset's name, or a
    folder's real path with its entries' modification times, so that `generate` reuses the
    model it loaded and loads a folder converted again anew."""
    if not isinstance(model, str | os.PathLike):
        return None
    path = os.fspath(model)
    if not os.path.isdir(path):
        return ("name", path)
    real = os.path.realpath(path)
    return ("folder", real, tuple(sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(real))))


def compact_engine_options(prompt_lens: list[int], max_new_tokens: int,
                           loops: int | None = None, exit_weighted: bool = False) -> dict:
    """Engine options sized to one batch of prompts (two compiled buckets per loop count); the
    prefill chunk is capped like the engine's (EngineConfig.max_prefill_tokens, run 12); the
    weighted-exit steps compiled where the requests ask for them (Ouro's exit_weighted)."""
    rows = min(32, 1 << max(0, len(prompt_lens) - 1).bit_length())
    chunk = min(EngineConfig.max_prefill_tokens, 1 << max(4, (sum(prompt_lens) - 1).bit_length()))
    context = 1 << max(6, (max(prompt_lens) + max_new_tokens - 1).bit_length())
    return {"max_num_rows": rows, "decode_row_buckets": (rows,), "max_prefill_tokens": chunk,
            "prefill_token_buckets": (chunk,), "max_prefill_rows": min(4, rows),
            "max_context_len": context, "max_loops": loops, "verbose": False,
            "loop_buckets": () if loops is None else (loops,), "enable_weighted_exit": exit_weighted}


def generate(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             initial_state=None, warm_start: bool = False, engine_options: dict | None = None,
             **sampling_kwargs: Any) -> list[GenerateOutput]:
    """Generate for `prompts` (strings, token-id lists, vLLM's prompt dicts, or one of them) with
    `model` (a Model, or what `loopjax.load` takes: a checkpoint or HF folder, a cached Hub name, a
    preset name). The engine (and a model loaded by name) is kept for
    later calls with the same model and options. Returns one GenerateOutput per prompt and
    sample, as `LLM.generate` (with `n` samples, prompt p's sample i is result p * n + i). The
    prompts and sampling settings are checked before an engine is built (it takes a while)."""
    source = _source(model)
    loaded = next((llm.model for (src, _), llm in _CACHE.items() if source and src == source), None)
    model = loaded if loaded is not None else _model(model)
    prompt_list, one_prompt = _prompt_list(prompts)
    if not prompt_list:
        raise ValueError("prompts is empty")
    states = _state_list(initial_state, len(prompt_list), one_prompt)  # before an engine is built
    if "max_tokens" in sampling_kwargs:  # NOTE: LLM.generate's alias; a TypeError of SamplingParams here
        raise ValueError("generate takes max_new_tokens (SamplingParams' max_tokens); give it alone")
    _check_max_new_tokens(max_new_tokens)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, **sampling_kwargs)
    check_for_model(params, model.cfg, has_tokenizer=model.tokenizer is not None, warm_start=warm_start)
    check_n(params.n, DEFAULT_MAX_N, "LLM's")  # before n requests are sized for
    # the engine's depth checks (its default depth is at most the model's); weighted steps are built
    check_exit_depth(params, params.loops or model.cfg.default_loops, weighted_steps=True, fused=True)
    given = [_prompt_ids(model, p, k) for k, p in enumerate(prompt_list)]
    ids = [params.truncate(prompt) for prompt in given]
    for full, prompt, state in zip(given, ids, states):  # NOTE: the engine's s0 checks, before it is built
        check_state_truncation(state, len(full), len(prompt))
        initial_state_extra(model.cfg, state, "seeded", len(prompt))
    lengths = [len(p) for p in ids]
    if max(lengths) >= model.cfg.max_context_len:
        raise ValueError(f"a prompt of {max(lengths)} tokens leaves no room to generate within the "
                         f"model's context of {model.cfg.max_context_len} tokens")
    # a copy: the caller's engine_options stay as given
    # NOTE: sized for every request: n samples of a prompt are n requests, each prefilled privately
    # NOTE: params' values (Python's ints), not the arguments as given (a numpy int has no bit_length)
    budget = params.output_budget(model.cfg.max_context_len - max(lengths))  # max_tokens=None: the context
    options = dict(engine_options or compact_engine_options(lengths * params.n, budget,
                                                            params.loops, params.exit_weighted))
    # NOTE: lists as EngineConfig takes them, as tuples: the options key the engine cache
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    options.setdefault("max_context_len", None)
    if options["max_context_len"] is not None:
        options["max_context_len"] = min(options["max_context_len"], model.cfg.max_context_len)
    # NOTE: the engine would refuse such a prompt once built (compiled): refused here
    context = EngineConfig(**options).context_len(model.cfg.max_context_len)
    if max(lengths) >= context:
        raise ValueError(f"a prompt of {max(lengths)} tokens leaves no room to generate within the "
                         f"engine's max_context_len={context}")
    key = (source or ("object", id(model)), tuple(sorted(options.items())))
    llm = _CACHE.get(key)
    if llm is None or llm.model is not model:
        _CACHE.clear()  # keep one engine: its KV pool holds device memory
        llm = _CACHE[key] = LLM(model, **options)
    return llm.generate(prompt_list, params, initial_state=states, warm_start=warm_start)
