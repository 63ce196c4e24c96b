"""`loopjax generate MODEL --prompt TEXT | --prompt-ids 1,2,3 [options]`.

MODEL is a loopjax checkpoint folder, a Hugging Face folder, a Hub name in the local Hugging
Face cache or a preset name. Prints the generated text (or token ids without a tokenizer), or
one JSON object with --json. Errors are one line on stderr with exit code 2, naming the flags
(not the EngineConfig / SamplingParams fields); Ctrl-C is one line with exit code 130.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from loopjax.engine_args import add_sampling_arguments, failure_line, sampling_options
from loopjax.engine_config import OPTION_CHOICES
from loopjax.sampling_params import EXIT_CRITERIA, EXIT_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder, HF folder, cached Hub name or preset")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as one user message, rendered by the checkpoint's chat template")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    add_sampling_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--loops", type=int, default=None, help="loops per token (default: the model's)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--dtype", default=None,
                        help="bfloat16 | float32 | auto (default: auto, the checkpoint's)")
    parser.add_argument("--kv-layout", default="per_loop", choices=OPTION_CHOICES["kv_layout"],
                        help="default: per_loop")
    parser.add_argument("--shared-kv-slots", type=int, default=None,
                        help="Huginn with --kv-layout shared: the K loops' KV its ring keeps (default: 8)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=OPTION_CHOICES["attention_backend"], help="default: auto")
    exits = parser.add_argument_group("loops and exits (per request; see SamplingParams)")
    exits.add_argument("--exit-mode", choices=EXIT_MODES, default="select",
                       help="select (default): run every loop, pick by the rule; skip: stop at the exit")
    exits.add_argument("--exit-threshold", type=float, default=None,
                       help="Ouro Q-exit threshold, or the Huginn criterion's threshold")
    exits.add_argument("--exit-criterion", default=None, choices=EXIT_CRITERIA,
                       help="Huginn's adaptive exit rule (default: none, a fixed depth)")
    exits.add_argument("--exit-min-loops", type=int, default=1,
                       help="--exit-criterion: no exit before this many loops (default: 1)")
    exits.add_argument("--exit-check-every", type=int, default=1,
                       help="--exit-criterion: check the rule every this many loops (default: 1)")
    exits.add_argument("--no-exit-in-prefill", dest="exit_in_prefill", action="store_false",
                       help="--exit-criterion: the prompt runs every loop (do_not_exit_in_prefill)")
    exits.add_argument("--exit-trace", default=None,
                       help="comma-separated loops per generated token to replay, e.g. 4,2,3")
    exits.add_argument("--exit-step", type=int, default=None,
                       help="Ouro: take the logits of this loop (0-based, the reference's exit_at_step)")
    exits.add_argument("--exit-weighted", action="store_true",
                       help="Ouro: the exit-probability-weighted sum of every loop's logits")
    exits.add_argument("--warm-start", action="store_true",
                       help="Huginn: start each token from ln_f of the previous token's state")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        if (line := failure_line(e, args)) is None:
            raise
        # NOTE: generate's one prompt ("prompt 0" to `loopjax.generate`) is the flag that gave it
        flag = "--prompt-ids" if args.prompt_ids is not None else "--prompt"
        print(f"loopjax generate: error: {re.sub(r'^prompt 0(?!\d)', flag, line)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while compiling or generating: 128 + SIGINT, as a shell says
        print("loopjax generate: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    from loopjax.chat import encode_chat
    from loopjax.llm import compact_engine_options, generate
    from loopjax.model import load

    if args.chat and args.prompt is None:
        raise ValueError("--chat takes a --prompt text (the user's message), not --prompt-ids")
    if args.prompt_ids is not None:
        prompt = _int_list("--prompt-ids", args.prompt_ids)
    else:
        prompt = args.prompt
    model = load(args.model, args.dtype)
    if args.chat:
        prompt = encode_chat(model, [{"role": "user", "content": prompt}])
    length = len(prompt) if isinstance(prompt, list) else len(model.tokenize(prompt))
    options = compact_engine_options([max(1, length)], max(1, args.max_tokens), args.loops,
                                     args.exit_weighted)
    options.update(kv_layout=args.kv_layout, attention_backend=args.attention_backend)
    if args.shared_kv_slots is not None:
        options["shared_kv_slots"] = args.shared_kv_slots
    exit_settings = {"exit_mode": args.exit_mode, "exit_threshold": args.exit_threshold,
                     "exit_criterion": args.exit_criterion, "exit_min_loops": args.exit_min_loops,
                     "exit_check_every": args.exit_check_every, "exit_in_prefill": args.exit_in_prefill,
                     "exit_trace": _int_list("--exit-trace", args.exit_trace),
                     "exit_step": args.exit_step, "exit_weighted": args.exit_weighted}
    if args.warm_start:
        exit_settings["warm_start"] = True
    out = generate(model, [prompt], max_new_tokens=args.max_tokens, seed=args.seed, loops=args.loops,
                   ignore_eos=args.ignore_eos, engine_options=options,
                   **sampling_options(args), **exit_settings)[0]
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "exit_loops": out.exit_loops,
                          "finish_reason": out.finish_reason, "metrics": out.metrics}))
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0


def _int_list(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
