"""`loopjax` command line: one subcommand per module, imported only when used.

Each subcommand module provides `add_arguments(parser)` and `run(args) -> int`, so a
subcommand's heavy imports (jax, fastapi) never slow down or break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from loopjax import __version__

SUBCOMMANDS = {
    "convert": ("loopjax.convert.cli", "convert a Hugging Face checkpoint to a loopjax checkpoint"),
    "generate": ("loopjax.generate_cli", "generate text or tokens with a model"),
    "serve": ("loopjax.serve_cli", "serve a model over an OpenAI-compatible HTTP API"),
    "bench": ("loopjax.bench.cli", "run the burst or sessions workload and report TTFT/TPOT/throughput"),
}

# The extra that brings a subcommand's optional imports.
EXTRAS = {"serve": "serve"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loopjax", description="JAX engine for looped language models")
    parser.add_argument("--version", action="version", version=f"loopjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in SUBCOMMANDS:  # import only the module that is used
        names = [argv[0]]
    else:
        names = list(SUBCOMMANDS)
    modules = {}
    for name in SUBCOMMANDS:
        module_name, help_text = SUBCOMMANDS[name]
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in names and argv and argv[0] == name:
            try:
                modules[name] = importlib.import_module(module_name)
            except ModuleNotFoundError as e:  # an optional extra (fastapi for serve) is missing
                extra = EXTRAS.get(name)
                hint = f"; install it with: pip install 'loopjax[{extra}]'" if extra else ""
                print(f"loopjax {name}: error: missing module {e.name!r}{hint}", file=sys.stderr)
                return 2
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
