"""Engine options on the command line (`loopjax serve`, `loopjax bench`, the profile tool):
one `--<field>` per simple EngineConfig field, `--engine-arg KEY=VALUE` for any field, and
`build_engine(args)` -> (model, Engine); the sampling flags `loopjax generate` and `loopjax
bench` share; `failure_line`, the one-line start-up failure. Imports the engine (and JAX) only
when called, so `--help` works on a base install (the flags and their choices come from the
JAX-free engine_config.py).
"""

from __future__ import annotations

import difflib
import time
from typing import Any

from loopjax.request import StepFailedError

_SIMPLE_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def add_engine_arguments(parser):
    """`--dtype`, one `--<field>` per simple EngineConfig field, and `--engine-arg KEY=VALUE`."""
    import argparse
    import dataclasses

    parser.add_argument("--dtype", default=None,
                        help="params dtype (float32, bfloat16, auto; default: auto, the checkpoint's)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any EngineConfig field (repeatable); VALUE parses as JSON, else as a string")
    from loopjax.engine_config import APPLIES_TO, DEFAULT_WORDS, OPTION_CHOICES, EngineConfig

    group = parser.add_argument_group("engine options (EngineConfig fields; default: EngineConfig's)")
    for field in dataclasses.fields(EngineConfig):
        type_name = str(field.type).replace("| None", "").replace("Optional[", "").strip(" ]")
        is_tuple = type_name.startswith("tuple[") and type_name.endswith(", ...")
        kind = _SIMPLE_TYPES.get(type_name[len("tuple["):-len(", ...")] if is_tuple else type_name)
        flag = "--" + field.name.replace("_", "-")
        taken = parser._option_string_actions  # a subcommand's own flags win
        if kind is None or flag in taken or "--no-" + flag[2:] in taken:
            continue
        dest, text = "engine_" + field.name, f"default: {DEFAULT_WORDS.get(field.name, field.default)}"
        if field.name in APPLIES_TO:  # set off its default elsewhere: refused (check_family)
            text += f"; {APPLIES_TO[field.name]} only"
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        else:  # a field that names an implementation: its names ({auto,xla,...}), refused at parsing
            choices = OPTION_CHOICES.get(field.name)
            group.add_argument(flag, dest=dest, type=kind, default=None, nargs="+" if is_tuple else None,
                               choices=choices, metavar=None if choices else kind.__name__.upper(), help=text)


def engine_config_kwargs(args) -> dict:
    """EngineConfig keyword arguments given on the command line (unset ones are left out)."""
    import json

    kwargs = {k[len("engine_"):]: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
              if k.startswith("engine_") and k != "engine_arg" and v is not None}
    for item in getattr(args, "engine_arg", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        name = key.replace("-", "_")
        if name not in (fields := _engine_fields()):
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (the EngineConfig fields: --help)"
            raise ValueError(f"--engine-arg: unknown engine option {key!r}{hint}")
        kwargs[name] = tuple(parsed) if isinstance(parsed, list) else parsed
    return kwargs


def _engine_fields() -> list[str]:
    import dataclasses

    from loopjax.engine_config import EngineConfig

    return [f.name for f in dataclasses.fields(EngineConfig)]


def build_engine(args, timings: dict | None = None):
    """(model, Engine) from `args.model` (path or preset), `args.dtype` and the engine options.
    `timings` (if given) gets `load_s` (the model) and `warmup_s` (Engine construction: the
    KV pool and the compilation of every bucket), perf_counter seconds."""
    from loopjax.engine import Engine, EngineConfig
    from loopjax.model import load

    start = time.perf_counter()
    model = load(args.model, dtype=args.dtype) if args.dtype else load(args.model)
    loaded = time.perf_counter()
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except TypeError as e:  # an unknown field name
        raise ValueError(f"engine options: {e}") from None
    engine = Engine(model, config)
    if timings is not None:
        timings.update(load_s=loaded - start, warmup_s=time.perf_counter() - loaded)
    return model, engine


def failure_line(e: BaseException, args=None) -> str | None:
    """The one line a command prints when loading a model or building and running an engine
    fails for a reason the user can act on: a bad model or option (ValueError, OSError), too
    little memory (MemoryError, XLA's RESOURCE_EXHAUSTED RuntimeError, also as the cause the
    Engine's one-line step failure names) or another device error (the Engine's StepFailedError,
    which names it); None for anything else (a bug, whose traceback should stay) and for a
    broken stdout pipe (`cli.run_command` ends quietly). With the command's parsed `args`, the
    options it names are its flags (`with_flag_names`)."""
    line = _failure_line(e)
    return line if line is None or args is None else with_flag_names(line, args)


def _failure_line(e: BaseException) -> str | None:
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, BrokenPipeError):
        return None
    if isinstance(e, ValueError | OSError):
        return first or type(e).__name__
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "RESOURCE_EXHAUSTED" in first):
        return f"out of memory: {first}" if first else "out of memory"
    if isinstance(e, StepFailedError):
        return first
    return None


# Options a flag of another name sets: `generate`'s keyword max_new_tokens is `--max-tokens`.
_FLAG_OF = {"max_new_tokens": "max_tokens"}


def with_flag_names(line: str, args, names=None) -> str:
    """`line` (an error of the engine or of SamplingParams, which name their fields, as Python
    callers use them) as a command-line user reads it: each EngineConfig or SamplingParams field
    the command has a flag for named by that flag (`EngineConfig.kv_memory_bytes` and
    `kv_memory_bytes` -> `--kv-memory-bytes`), and a value given as Python writes it as typed
    (`--exit-mode='skip'` -> `--exit-mode skip`, `--exit-in-prefill=False` ->
    `--no-exit-in-prefill`). A bare name is taken anywhere with an underscore in it, a plain word
    (`loops`, `temperature`) only as the line's subject, its first word: elsewhere it may be prose
    (`matmul`, `seed`). `names`: the option names to look for (default: those fields,
    `generate`'s keywords and the command's own flags named with an underscore,
    `override_generation_config`)."""
    import re

    given = vars(args)
    own = [dest for dest in given if "_" in dest and not dest.startswith("engine_")]
    for name in _option_names() + own if names is None else names:
        flag = _FLAG_OF.get(name, name)
        if flag not in given and "engine_" + flag not in given:
            continue  # no flag of this command sets it
        bare = ("|" if "_" in name else r"|\A") + re.escape(name)
        line = re.sub(rf"(?<![\w.-])(?:EngineConfig\.{re.escape(name)}{bare})(?!\w)",
                      "--" + flag.replace("_", "-"), line)
    return re.sub(r"(?<![\w-])--([a-z][\w-]*)=('[^']*'|True|False|-?[\d.]+(?![\w.]))", _as_typed, line)


def _as_typed(match) -> str:
    """`--flag=VALUE` (a flag named with its value as Python's repr) as a command line takes it."""
    flag, value = match.groups()
    if value in ("True", "False"):  # a switch: --flag / --no-flag
        return f"--{'no-' if value == 'False' else ''}{flag}"
    return f"--{flag} {value.strip(chr(39))}"


def _option_names() -> list[str]:
    """The fields of EngineConfig and SamplingParams and `generate`'s own keywords (warm_start,
    ...): the options errors name."""
    import dataclasses
    import inspect

    from loopjax.llm import generate
    from loopjax.sampling_params import SamplingParams

    return (_engine_fields() + [f.name for f in dataclasses.fields(SamplingParams)]
            + list(inspect.signature(generate).parameters))


# The sampling flags `loopjax generate` and `loopjax bench` share: SamplingParams' own names
# (and the OpenAI request fields of the same names), greedy by default.
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p",
                  "repetition_penalty", "frequency_penalty", "presence_penalty")


def add_sampling_arguments(parser) -> None:
    """Adds --temperature, --top-k, --top-p, --min-p and the three penalties to an argparse
    parser; `sampling_options(args)` reads them back as SamplingParams keywords."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="[1e-4, 1e4]; prompt and output tokens (1 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]; output tokens")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]; output tokens")


def sampling_options(args) -> dict[str, Any]:
    """The SAMPLING_FLAGS of parsed arguments, by SamplingParams name."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS}
