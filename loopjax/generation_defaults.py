"""The model's recommended sampling defaults (vLLM's `--generation-config`), shared by the server
and `LLM`.

vLLM's rule: with source "auto" (its default), generation_config.json's `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`) are the default
values of requests that do not set them; only values that differ from Hugging Face's
GenerationConfig defaults count (vLLM reads the file's diff against them: a `top_k` of 50 there
leaves vLLM's 0). `do_sample` is not read (vLLM's: a temperature given applies either way).
Source "vllm": none (SamplingParams' own defaults). vLLM's `override_generation_config` (a dict
of those generation_config.json keys) is merged over the file's under either source: its values
count as given (even Hugging Face's defaults), and a null one removes the file's default. Keys
vLLM does not read are refused here (vLLM drops them silently: `max_tokens` for
`max_new_tokens` would do nothing). Pure Python; one-line ValueErrors.
"""

from __future__ import annotations

GENERATION_CONFIG_SOURCES = ("auto", "vllm")
# SamplingParams field of each generation_config.json key vLLM reads
_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
           "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
# Hugging Face's GenerationConfig() values: vLLM reads the file's differences from them only
_HF_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def sampling_defaults(generation_config: dict | None, source: str = "auto",
                      override: dict | None = None) -> dict:
    """{SamplingParams field: value} of the model's generation_config.json (its parsed dict, None or
    {} without one) under `source` ("auto" | "vllm"), `override` (vLLM's override_generation_config)
    merged over it, checked as SamplingParams checks them."""
    from loopjax.sampling_params import SamplingParams

    if source not in GENERATION_CONFIG_SOURCES:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_SOURCES)}, "
                         f"got {source!r}")
    config = generation_config if source == "auto" and isinstance(generation_config, dict) else {}
    merged = {key: config[key] for key in _FIELDS
              if config.get(key) is not None and not _is_hf_default(key, config[key])}
    merged |= check_override(override)
    defaults = {_FIELDS[key]: value for key, value in merged.items() if value is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        whose = "override_generation_config's" if override else "generation_config.json's"
        raise ValueError(f"{whose} sampling defaults are not usable ({e}); serve with generation_config "
                         f"'vllm' to ignore the model's") from None
    return defaults


def check_override(override) -> dict:
    """override_generation_config as a dict of generation_config.json keys ({} for None), or a
    one-line ValueError naming what is wrong."""
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be an object of generation_config.json keys, "
                         f"got {override!r}")
    for key in override:
        if key not in _FIELDS:
            raise ValueError(f"override_generation_config key {key!r} is not one vLLM reads (the sampling "
                             f"defaults: {', '.join(_FIELDS)})")
    return dict(override)


def _is_hf_default(key: str, value) -> bool:
    default = _HF_DEFAULTS.get(key)
    return default is not None and not isinstance(value, bool) and value == default


def with_defaults(body: dict, defaults: dict) -> dict:
    """A request body (OpenAI's fields) whose sampling fields absent or null take `defaults`'
    values (vLLM's); max_tokens is the caller's (it applies where the request leaves it open)."""
    missing = {k: v for k, v in defaults.items() if k != "max_tokens" and body.get(k) is None}
    return {**body, **missing} if missing else body
