"""`loopjax convert HF_DIR OUT_DIR [--dtype bfloat16|float32|auto]` (also `python -m loopjax.convert`).

Exit status 0 on success; every failure is one line on stderr
(`loopjax convert: error: ...`) and exit status 2, with no output folder left behind; Ctrl-C
is one line too, exit status 130 (128 + SIGINT, as a shell reports it), nothing left behind;
SIGTERM (`kill`, a job scheduler's stop) the same with exit status 143, and SIGHUP (the terminal or
ssh session closed) with 129.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading

PROG = "loopjax convert"


# Signals that end a conversion as Ctrl-C does (what convert wrote is removed), with their words;
# their default action kills at once and leaves the hidden temporary folder (gigabytes) behind.
ENDING_SIGNALS = {signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


class Terminated(BaseException):
    """An `ENDING_SIGNALS` signal (`signum`), raised in the main thread so that convert removes
    what it wrote (a BaseException, as KeyboardInterrupt is: no `except Exception` on the way may
    swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_raises():
    """`ENDING_SIGNALS` raise `Terminated` during the block (main thread only; put back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in ENDING_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face model folder (config.json + model*.safetensors), or a "
                             "Hub name whose snapshot is in the local Hugging Face cache")
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="new folder for the loopjax checkpoint (must not exist)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "auto"], default="bfloat16",
                        help="params dtype of the checkpoint (auto: the input's, bf16 if mixed or fp16; "
                             "default: bfloat16)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="do not show a progress bar while reading tensors")


def run(args: argparse.Namespace) -> int:
    # Orbax logs a failed background write, traceback and all, before the save raises it: the
    # error is printed below, in one line.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    try:
        # Imported here so that `loopjax --help` and argument errors never pay for JAX.
        from loopjax.convert.converter import convert

        with _sigterm_raises():
            out_dir = convert(args.hf_dir, args.out_dir, dtype=args.dtype, progress=args.progress)
    except KeyboardInterrupt:  # convert removed what it had written
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated as e:
        with contextlib.suppress(OSError):  # a hung-up terminal may take no more output
            print(f"{PROG}: {ENDING_SIGNALS[e.signum]}; nothing was written", file=sys.stderr)
        return 128 + e.signum
    except MemoryError:
        print(f"{PROG}: error: out of memory while converting {args.hf_dir}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # ConvertError, ConfigError, CheckpointError, I/O, Orbax
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from loopjax.cli import CommandParser, run_command

    parser = CommandParser(prog=PROG, description="convert a Hugging Face checkpoint to a loopjax checkpoint")
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))
