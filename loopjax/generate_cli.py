"""`loopjax generate MODEL --prompt TEXT | --prompt-ids 1,2,3 [options]`.

MODEL is a loopjax checkpoint folder, a Hugging Face folder or a preset name. Prints the
generated text (or token ids without a tokenizer), or one JSON object with --json. Errors are
one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder, Hugging Face folder or preset name")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--loops", type=int, default=None, help="loops per token (default: the model's)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: the checkpoint's)")
    parser.add_argument("--kv-layout", default="per_loop", choices=("per_loop", "shared"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        print(f"loopjax generate: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2


def _run(args) -> int:
    from loopjax.generate import compact_engine_options, generate
    from loopjax.model import load

    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, "
                             f"got {args.prompt_ids!r}") from None
    else:
        prompt = args.prompt
    model = load(args.model, args.dtype)
    length = len(prompt) if isinstance(prompt, list) else len(model.tokenize(prompt))
    options = compact_engine_options([max(1, length)], max(1, args.max_tokens), args.loops)
    options.update(kv_layout=args.kv_layout, attention_backend=args.attention_backend)
    out = generate(model, [prompt], max_new_tokens=args.max_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, loops=args.loops,
                   ignore_eos=args.ignore_eos, engine_options=options)[0]
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "exit_loops": out.exit_loops,
                          "finish_reason": out.finish_reason, "metrics": out.metrics}))
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0
