"""What a checkpoint folder says about its tokenizer besides tokenizer.json, read as
transformers reads it (pure Python; imports neither JAX nor tokenizers at import time).

- `special_tokens_map(folder)`: transformers' `special_tokens_map`, the named special tokens
  (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token) and
  additional_special_tokens, from tokenizer_config.json overridden by special_tokens_map.json;
  each as text (an AddedToken object gives its content). Chat templates get them as variables.
- `eos_token_id(tokenizer, folder)`: the tokenizer's EOS id, which vLLM stops at.
- `apply_add_special_tokens(tokenizer, folder)`: tokenizer_config.json's add_bos_token /
  add_eos_token over tokenizer.json's post-processor, as transformers' fast tokenizers apply
  them: the post-processor becomes [bos] $A [eos] by the two flags. The Llama-style classes
  (`BOS_BY_DEFAULT`, v4 and v5) always rebuild it, a flag not given taking the class's default
  (BOS on, EOS off: `add_eos_token` alone adds both); any other class (v5's rule; v4 left them
  alone) rebuilds it where either flag is given, a flag not given being off.
"""

from __future__ import annotations

import json
import os

# tokenizer_config.json's tokenizer_class values whose add_bos_token defaults to True (and
# add_eos_token to False), each rebuilding the post-processor from the two at load, as
# transformers' LlamaTokenizerFast, CodeLlamaTokenizerFast, GemmaTokenizerFast and
# CohereTokenizerFast do (configs name the slow class as often as the fast one).
BOS_BY_DEFAULT = frozenset(name + fast for name in ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer",
                                                     "CohereTokenizer") for fast in ("", "Fast"))
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDITIONAL = "additional_special_tokens"


def special_tokens_map(folder: str | None) -> dict:
    """The named special tokens the folder's files set (text) and additional_special_tokens (a
    list of texts), special_tokens_map.json's over tokenizer_config.json's; {} without files."""
    found: dict = {}
    for config in (_read(folder, "tokenizer_config.json"), _read(folder, "special_tokens_map.json")):
        for name in NAMED:
            if (text := _token_text(config.get(name))) is not None:
                found[name] = text
        extra = config.get(ADDITIONAL)
        if isinstance(extra, list):
            found[ADDITIONAL] = [t for t in map(_token_text, extra) if t is not None]
    return found


def eos_token_id(tokenizer, folder: str | None) -> int | None:
    """The id of the folder's eos_token in `tokenizer` (vLLM's primary EOS: the tokenizer's, not
    config.json's); None without a tokenizer, an eos_token, or that token in its vocabulary."""
    text = special_tokens_map(folder).get("eos_token")
    return None if tokenizer is None or text is None else tokenizer.token_to_id(text)


def apply_add_special_tokens(tokenizer, folder: str | None) -> None:
    """Put tokenizer_config.json's add_bos_token / add_eos_token on `tokenizer`'s post-processor
    (a `tokenizers.Tokenizer`, changed in place) by the module's rule; a flag whose token the
    files do not name, or the vocabulary lacks, adds nothing (transformers v5 turns it off)."""
    config = _read(folder, "tokenizer_config.json")
    defaults = {"bos": config.get("tokenizer_class") in BOS_BY_DEFAULT, "eos": False}
    if not defaults["bos"] and "add_bos_token" not in config and "add_eos_token" not in config:
        return  # tokenizer.json's post-processor as it is
    from tokenizers import processors

    names = special_tokens_map(folder)
    added = {}  # "bos" / "eos" -> (text, id), for the flags that are on
    for kind in ("bos", "eos"):
        text = names.get(f"{kind}_token")
        token_id = None if text is None else tokenizer.token_to_id(text)
        if config.get(f"add_{kind}_token", defaults[kind]) and token_id is not None:
            added[kind] = (text, token_id)

    def around(sequence: str, type_id: int) -> list[str]:  # template pieces "content:type_id"
        bos, eos = ([f"{added[k][0]}:{type_id}"] if k in added else [] for k in ("bos", "eos"))
        return [*bos, f"{sequence}:{type_id}", *eos]

    tokenizer.post_processor = processors.TemplateProcessing(
        single=around("$A", 0), pair=around("$A", 0) + around("$B", 1),
        special_tokens=list(added.values()))


def _token_text(value) -> str | None:
    """A special token's text: a string, or an AddedToken object's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read(folder: str | None, name: str) -> dict:
    """A JSON object file of the folder; {} when there is none (or it is not an object: the
    loader reports unreadable JSON where it reads the chat template)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:  # as transformers reads it
            data = json.load(f)
    except (OSError, TypeError, ValueError):  # no folder, no file, not JSON, not UTF-8
        return {}
    return data if isinstance(data, dict) else {}
