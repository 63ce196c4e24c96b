"""OpenAI completions / chat request bodies -> SamplingParams keyword arguments (pure Python).

Numbers are read as vLLM's pydantic models read them (lax mode, `with_lax_numbers`): a
whole-number float (`n: 2.0`) or a numeric string (`"max_tokens": "16"`) stands for the number;
`2.5` for an integer field is refused, as there, and so is `true` (vLLM's 1: a count sent as a
flag is a client's bug, refused rather than read as 1). Request fields that are not sampling
parameters (model, prompt, messages, stream...) are ignored; `null` values count as absent (a
null max_tokens or max_completion_tokens: up to the context, chat's in vLLM; the server reads
completions' as unset, 16, as current vLLM); an unknown field, a field
for what loopjax does not do (`_UNSUPPORTED`: tools, beam search...; taken at the value
clients send by default, of its JSON type, and tools only shown under tool_choice "none",
`shown_tools`), an unsupported value (best_of other than n) or a bad value raises a one-line ValueError naming
it (SamplingParams checks the values). logit_bias keys are token ids written as strings (JSON
object keys); chat's logprobs=true + top_logprobs=n and completions' logprobs=n both become
`logprobs`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from loopjax.sampling_params import MAX_BIAS, MAX_LOGPROBS, check_int


def _fail(msg: str):
    raise ValueError(msg)


def sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams(**kwargs) of a request body (`SamplingParams.from_openai`)."""
    if not isinstance(body, dict):
        _fail(f"request body must be a JSON object, got {type(body).__name__}")
    body = without_zero_max_completion_tokens(with_lax_numbers(body))
    kw: dict[str, Any] = {}
    for key, value in body.items():
        if value is None or key in _IGNORED_FIELDS:
            continue
        if key in _DIRECT_FIELDS:
            kw[key] = value
        elif key in _UNSUPPORTED:
            if not _asks_nothing(key, value, body):  # e.g. tools [], priority 0
                _fail(f"{key} is not supported by this server ({_UNSUPPORTED[key]})")
        elif key not in _SPECIAL_FIELDS:
            _fail(f"unknown request field {key!r}")
    _map_max_tokens(body, kw)
    best_of = body.get("best_of")
    if best_of is not None:  # NOTE: checked first: true and 1.0 equal n=1
        check_int("best_of", best_of, 1)
    if best_of is not None and best_of != kw.get("n", 1):
        _fail(f"best_of must equal n ({kw.get('n', 1)!r}): every sample is returned, got {best_of!r}")
    _map_logprobs(body, kw)
    if body.get("logit_bias") is not None:
        kw["logit_bias"] = _logit_bias_pairs(body["logit_bias"])
    stop = body.get("stop")
    if stop is not None:
        kw["stop"] = (stop,) if isinstance(stop, str) else stop
    for key in ("stop_token_ids", "exit_trace", "allowed_token_ids", "bad_words"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    return kw


# Fields passed through under the same name (OpenAI's and loopjax's extras).
_DIRECT_FIELDS = frozenset({
    "temperature", "top_p", "seed", "n", "top_k", "min_p", "stop_token_ids", "ignore_eos", "min_tokens",
    "prompt_logprobs", "allowed_token_ids", "truncate_prompt_tokens", "skip_special_tokens", "bad_words",
    "spaces_between_special_tokens", "include_stop_str_in_output", "cache_salt",
    "repetition_penalty", "frequency_penalty", "presence_penalty",
    "loops", "exit_mode", "exit_threshold", "exit_criterion", "exit_min_loops",
    "exit_check_every", "exit_in_prefill", "exit_trace", "exit_step", "exit_weighted",
})
# Fields mapped by hand below.
_SPECIAL_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs",
                             "best_of", "logit_bias"})
# OpenAI's and vLLM's fields for what loopjax does not do: refused by name (what it would need),
# unless the value asks for nothing (as clients send by default).
_UNSUPPORTED = {
    "response_format": "structured output", "tools": "tool calling", "tool_choice": "tool calling",
    "parallel_tool_calls": "tool calling", "functions": "tool calling", "function_call": "tool calling",
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding", "structured_outputs": "guided decoding",
    "logits_processors": "custom logits processors", "lora_request": "LoRA adapters",
    "suffix": "text insertion",
    # vLLM's extras (they were "unknown request field")
    "use_beam_search": "beam search", "length_penalty": "beam search", "priority": "priority scheduling",
    "guided_decoding_backend": "guided decoding", "guided_whitespace_pattern": "guided decoding",
    "structural_tag": "guided decoding",
    "mm_processor_kwargs": "multimodal input",
    "prompt_embeds": "prompt embeddings", "include_reasoning": "reasoning parsing",
    # vLLM's newer extras (they were "unknown request field")
    "truncation_side": "truncation from the right", "watermarking": "watermarking",
    "logprob_token_ids": "log-probabilities of chosen token ids", "thinking_token_budget": "thinking budgets",
    "media_io_kwargs": "multimodal input", "repetition_detection": "repetition detection",
    "return_prompt_text": "the rendered prompt's text", "routed_experts_prompt_start": "expert routing",
    # OpenAI's newer chat fields (vLLM ignores them; they were "unknown request field")
    "modalities": "audio output", "audio": "audio output", "prediction": "predicted outputs",
    "web_search_options": "web search", "verbosity": "verbosity control",
}
_HARMLESS = {"response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
             "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",),
             "suffix": ("",), "use_beam_search": (False,), "length_penalty": (1.0,),
             "priority": (0,), "include_reasoning": (True, False),  # no reasoning parser: no effect
             "mm_processor_kwargs": ({},), "modalities": (["text"],), "truncation_side": ("left",),
             "watermarking": (False,), "media_io_kwargs": ({},), "return_prompt_text": (False,),
             "routed_experts_prompt_start": (0,),
             "verbosity": ("medium",)}
# Request fields that are not sampling parameters: the server handles them.
_IGNORED_FIELDS = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "user", "echo",
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",  # OpenAI's bookkeeping
    "add_special_tokens", "add_generation_prompt", "chat_template", "chat_template_kwargs", "documents",
    "continue_final_message", "request_id", "return_token_ids", "return_tokens_as_token_ids",
    # vLLM's, checked by the server: chat's template variable; what only vLLM's plugins and KV
    # connectors read (none here: no effect on the output, as on a vLLM server without them)
    "reasoning_effort", "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "session_id",
    "stream_interval", "return_token_offsets", "return_mm_kwargs",  # chunking; render endpoints' only
})


# The request's integer fields (vLLM's and loopjax's), its lists of integers, and its real ones.
_INT_FIELDS = frozenset({"n", "best_of", "max_tokens", "max_completion_tokens", "seed", "top_k", "min_tokens",
                         "logprobs", "top_logprobs", "prompt_logprobs", "truncate_prompt_tokens",
                         "stream_interval", "priority", "loops", "exit_min_loops", "exit_check_every",
                         "exit_step"})
_INT_LIST_FIELDS = frozenset({"stop_token_ids", "allowed_token_ids", "exit_trace"})
_REAL_FIELDS = frozenset({"temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                          "presence_penalty", "length_penalty", "exit_threshold"})
# vLLM's validators compare these with numbers before pydantic converts them: a string is refused
_NO_STRING_FIELDS = frozenset({"logprobs", "top_logprobs", "prompt_logprobs"})
_WHOLE_STRING = re.compile(r"[+-]?\d+(?:\.0*)?")  # what pydantic reads as an integer ("5", "5.0")
_REAL_STRING = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def with_lax_numbers(body: dict) -> dict:
    """`body` with its numbers as vLLM's pydantic (lax mode) reads them: an integer field's
    whole-number float as the int (`n: 2.0` -> 2) and its numeric string too (`"16"`, `"16.0"`;
    not logprobs': `_NO_STRING_FIELDS`), a real field's numeric string as the float (logit_bias'
    values too: vLLM's dict[str, float]); what is left
    as sent (2.5, "2.5", true, "x") is refused by the checks that follow, naming the field."""
    changed = {}
    for key in body.keys() & (_INT_FIELDS | _REAL_FIELDS):
        value = _lax_number(body[key], key in _INT_FIELDS, key not in _NO_STRING_FIELDS)
        if value is not body[key]:
            changed[key] = value
    for key in body.keys() & _INT_LIST_FIELDS:
        if isinstance(body[key], list):
            changed[key] = [_lax_number(v, True, True) for v in body[key]]
    if isinstance(body.get("logit_bias"), dict):
        changed["logit_bias"] = {k: _lax_number(v, False, True) for k, v in body["logit_bias"].items()}
    return body | changed if changed else body


def _lax_number(value, integer: bool, strings: bool):
    if strings and isinstance(value, str):
        text = value.strip()
        if integer and _WHOLE_STRING.fullmatch(text):
            return int(text.partition(".")[0])
        if not integer and _REAL_STRING.fullmatch(text):
            return float(text)
    if integer and type(value) is float and value.is_integer():
        return int(value)
    return value


def shown_tools(body: dict) -> list | None:
    """The request's tools where its tool_choice is "none": vLLM's chat template shows them
    (its `tools` variable) and no call is parsed; None otherwise."""
    tools = body.get("tools")
    return tools if isinstance(tools, list) and body.get("tool_choice") == "none" else None


def _asks_nothing(key: str, value, body: dict) -> bool:
    """`key`'s value asks for nothing loopjax lacks: a harmless value, or tools only shown."""
    if key == "tools" and shown_tools(body) is not None:
        return True
    if key == "tool_choice" and value == "required" and body.get("tools") == []:  # vLLM's: as "none"
        return True
    return any(_same(value, v) for v in _HARMLESS.get(key, ()))


def _same(value, harmless) -> bool:
    """`value` is the harmless value, of its JSON type (`==` let priority false pass as 0 and
    use_beam_search 0 as false); an integer stands for a float (length_penalty 1)."""
    kind = type(harmless)
    return value == harmless and (type(value) is kind or (kind is float and type(value) is int))


def _logit_bias_pairs(bias) -> tuple[tuple[int, Any], ...]:
    """OpenAI's logit_bias object {"token id": bias} as (id, bias) pairs (checked by the params); a
    bias outside [-MAX_BIAS, MAX_BIAS] (+-inf too: JSON's Infinity, 1e999) is clamped into it, as
    vLLM's server does; NaN is left to the params' refusal (vLLM's clamp makes it -100: a token
    banned by accident)."""
    if not isinstance(bias, dict):
        _fail(f"logit_bias must be an object mapping token ids to biases, got {bias!r}")
    pairs = []
    for key, value in bias.items():
        if not isinstance(key, str | int) or isinstance(key, bool) or not str(key).strip().isdecimal():
            _fail(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        number = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        pairs.append((int(key), min(MAX_BIAS, max(-MAX_BIAS, value)) if number else value))
    return tuple(pairs)


def without_zero_max_completion_tokens(body: dict) -> dict:
    """`body` less a max_completion_tokens of 0: vLLM takes `max_completion_tokens or max_tokens`,
    so 0 asks nothing (max_tokens, else the default, applies)."""
    zero = type(body.get("max_completion_tokens")) is int and body["max_completion_tokens"] == 0
    return {k: v for k, v in body.items() if k != "max_completion_tokens"} if zero else body


def _map_max_tokens(body, kw):
    """max_completion_tokens, else max_tokens (vLLM's: the first wins where both are given)."""
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if b is not None:
        check_int("max_completion_tokens", b, 1)
        kw["max_tokens"] = b
    elif a is not None:
        kw["max_tokens"] = a
    elif "max_tokens" in body or "max_completion_tokens" in body:  # sent as null: up to the context
        kw["max_tokens"] = None


def _map_logprobs(body, kw):
    """Chat: logprobs=true plus top_logprobs=n. Completions: logprobs=n. top_logprobs=0 asks
    nothing: it needs no logprobs=true (as vLLM's)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not lp and type(top) is int and top == 0:
        top = None
    if isinstance(lp, bool):
        if lp:
            if top is not None:
                check_int("top_logprobs", top, 0, MAX_LOGPROBS)
            kw["logprobs"] = 0 if top is None else top
        elif top is not None:
            _fail("top_logprobs requires logprobs=true")
    elif lp is not None:
        if top is not None:
            _fail("top_logprobs goes with logprobs=true, not with an integer logprobs")
        kw["logprobs"] = lp
    elif top is not None:
        _fail("top_logprobs requires logprobs=true")
