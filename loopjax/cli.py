"""`loopjax` command line: one subcommand per module, imported only when used.

Each subcommand module provides `add_arguments(parser)` and `run(args) -> int`, so a
subcommand's heavy imports (jax, fastapi) never slow down or break the others. A bad flag is
one line naming the subcommand and the cause, exit code 2 (`CommandParser`); a reader of the
output that goes away ends the command quietly, exit code 141 (`run_command`).
"""

from __future__ import annotations

import argparse
import importlib
import os
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
SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the cause, exit code 2
    (argparse's printed its usage block first, a screen of flags above the one line that matters)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_at_least(low: int, high: int | None = None):
    """An argparse type: decimal digits only, at least `low` (and at most `high`), refused at
    parsing (naming the flag), not after the engine is built."""
    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) < low or (high is not None and int(text) > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return int(text)
    return parse


def run_command(run, args) -> int:
    """`run(args)` with its output flushed; a reader of stdout that went away (`loopjax generate
    ... | head -1`) ends it quietly with SIGPIPE_EXIT, as Unix tools end, not with a traceback or
    an error line. stdout then points at /dev/null: the interpreter's flush at exit would
    report the broken pipe again."""
    try:
        code = run(args)
        sys.stdout.flush()  # NOTE: a short output stays buffered until here; flushed at exit it fails there
        return code
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # no file descriptor (a captured stdout): nothing to flush at exit
            pass
        return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(prog="loopjax", description="JAX engine for looped language models")
    parser.add_argument("--version", action="version", version=f"loopjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in SUBCOMMANDS:  # import only the module that is used
        names = [argv[0]]
    else:
        names = list(SUBCOMMANDS)
    modules, parsers = {}, {}
    for name in SUBCOMMANDS:
        module_name, help_text = SUBCOMMANDS[name]
        p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name in names and argv and argv[0] == name:
            try:
                modules[name] = importlib.import_module(module_name)
            except ModuleNotFoundError as e:  # an optional extra (fastapi for serve) is missing
                extra = EXTRAS.get(name)
                hint = f"; install it with: pip install 'loopjax[{extra}]'" if extra else ""
                print(f"loopjax {name}: error: missing module {e.name!r}{hint}", file=sys.stderr)
                return 2
            modules[name].add_arguments(p)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's parse_args names the top-level parser ("loopjax: error: ...")
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(modules[args.command].run, args)


if __name__ == "__main__":
    sys.exit(main())
