"""`loopjax serve MODEL`: the command line of the OpenAI-compatible server (loopjax/server.py):
its flags (with every EngineConfig field), then bind the port, build the engine and serve until
SIGINT / SIGTERM. Start-up failures are one line on stderr and exit code 2. Importing this
module imports the server (FastAPI), so `loopjax serve` names a missing `serve` extra at once.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import os
import socket
import sys
import threading

from loopjax import server
from loopjax.cli import int_at_least
from loopjax.generation_defaults import GENERATION_CONFIG_SOURCES
from loopjax.openai_protocol import DEFAULT_MAX_N

log = logging.getLogger("loopjax.server")
APP_OPTIONS = tuple(inspect.signature(server.create_app).parameters)  # the names its refusals give
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # uvicorn's but trace (not a logging level)


def _window_ms(text: str) -> float:
    """An argparse type: milliseconds the engine thread can wait, by the AsyncEngine's rule
    (`check_seconds`: inf, and more than threading.TIMEOUT_MAX seconds, passed here and were a
    traceback once the engine was built)."""
    from loopjax.async_engine import check_seconds

    try:
        value = float(text)
        check_seconds("admission_window_s", value / 1e3, zero_ok=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, {threading.TIMEOUT_MAX * 1e3:g}] "
                                         f"(milliseconds), got {text!r}") from None
    return value


def _api_key(text: str) -> str:
    """An argparse type: a key a client can send (an empty one refused every /v1 request)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave it out, and $LOOPJAX_API_KEY unset, "
                                         "for no key)")
    return text


def _non_empty(what: str):
    """An argparse type: text that is not blank (a blank --host bound every interface, a blank
    --served-model-name served a model no client could name)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty ({what})")
        return text
    return parse


def _origins(text: str) -> list[str]:
    """--allowed-origins: a JSON list of origins (vLLM's flag and form), refused at parsing."""
    try:
        origins = json.loads(text)
    except ValueError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise argparse.ArgumentTypeError(f'must be a JSON list of origins (e.g. \'["*"]\'), got {text!r}')
    return origins


def _generation_override(text: str) -> dict:
    """--override-generation-config: a JSON object of generation_config.json keys (vLLM's flag),
    refused at parsing (`check_override`; its values are checked with the model's defaults)."""
    from loopjax.generation_defaults import check_override

    try:
        return check_override(json.loads(text))
    except ValueError as e:  # NOTE: json's JSONDecodeError is a ValueError too
        why = f"not JSON ({e})" if isinstance(e, json.JSONDecodeError) else str(e)
        raise argparse.ArgumentTypeError(why) from None


def _chat_template(text: str) -> str:
    """--chat-template: a template file's text, or the template itself (vLLM's flag, read as
    vLLM reads it: text without braces or newlines must be a file), checked at parsing."""
    from loopjax.chat import check_template

    try:
        with open(text) as f:
            template = f.read()
    except OSError as e:
        if not any(c in text for c in "{}\n"):
            raise argparse.ArgumentTypeError(f"cannot read the chat template file {text!r}: "
                                             f"{e.strerror}") from None
        template = text
    try:
        check_template(template)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return template


def add_arguments(parser):
    from loopjax.engine_args import add_engine_arguments

    parser.add_argument("model", help="checkpoint folder, HF folder, cached Hub name or preset")
    parser.add_argument("--host", type=_non_empty("0.0.0.0: every interface"), default="127.0.0.1",
                        help="default: 127.0.0.1")
    parser.add_argument("--port", type=int_at_least(0, 65535), default=8000,
                        help="default: 8000; 0: any free port")
    parser.add_argument("--served-model-name", nargs="+", type=_non_empty("a name clients send as `model`"),
                        default=None, metavar="NAME",
                        help="the name clients send as `model` (default: MODEL as given); more names "
                             "are aliases, as vLLM's (responses carry the first)")
    parser.add_argument("--max-waiting", type=int_at_least(1), default=256,
                        help="requests that may wait for a first token before new ones get 429 "
                             "(default: 256)")
    parser.add_argument("--max-n", type=int_at_least(1), default=DEFAULT_MAX_N,
                        help=f"the largest `n` (samples per prompt) a request may ask for "
                             f"(default: {DEFAULT_MAX_N})")
    parser.add_argument("--admission-window-ms", type=_window_ms, default=0.0,
                        help="an idle engine takes requests arriving less than this apart before "
                             "its first step (at most 10 windows; default 0: off)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="loopjax's and uvicorn's (default: info; other libraries log from warning)")
    parser.add_argument("--api-key", type=_api_key, default=os.environ.get("LOOPJAX_API_KEY") or None,
                        help="/v1 requests must send 'Authorization: Bearer KEY' (default: "
                             "$LOOPJAX_API_KEY; unset: no key)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="chat requests may send their own chat_template (vLLM's; rendered in "
                             "jinja2's sandbox; default: refused with a 400)")
    parser.add_argument("--chat-template", type=_chat_template, default=None,
                        help="the chat template to serve instead of the checkpoint's: a jinja2 file or "
                             "the template itself (vLLM's)")
    parser.add_argument("--generation-config", choices=GENERATION_CONFIG_SOURCES, default="auto",
                        help="'auto': the model's generation_config.json sets the sampling defaults "
                             "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) of "
                             "requests that leave them unset; 'vllm': no model defaults (vLLM's flag; "
                             "default: auto)")
    parser.add_argument("--override-generation-config", type=_generation_override, default=None,
                        metavar="JSON",
                        help="generation_config.json keys merged over the model's sampling defaults, "
                             "e.g. '{\"temperature\": 0.5}' (vLLM's flag; null removes one; applies under "
                             "--generation-config vllm too)")
    parser.add_argument("--allowed-origins", type=_origins, default=["*"],
                        help='the origins browsers may call the server from (CORS), a JSON list as '
                             'vLLM\'s (default: \'["*"]\'; \'[]\': none)')
    add_engine_arguments(parser)


def configure_logging(level: str) -> None:
    """`--log-level` for loopjax's own loggers (uvicorn sets its own); every other library's
    (orbax's and absl's checkpoint restore, jax's backend probe: a dozen INFO lines at start-up)
    logs from WARNING, or at `level` where that is higher or `debug`."""
    level_no = logging.getLevelName(level.upper())
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level_no if level_no == logging.DEBUG else max(level_no, logging.WARNING))
    logging.getLogger("loopjax").setLevel(level_no)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not listening: a connection is refused until uvicorn serves)
    with uvicorn's options, before the engine is built, as vLLM does: a port in use fails at
    once, not after the warm-up and after this process took device memory beside the server
    that holds the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _app(args, model, engine, names: list[str]):
    """The server's app of the parsed flags; create_app's one-line ValueError for an option it refuses."""
    return server.create_app(engine, names[0], model=model, model_aliases=tuple(names[1:]),
                             max_waiting=args.max_waiting, max_n=args.max_n,
                             admission_window_s=args.admission_window_ms / 1e3, api_key=args.api_key,
                             trust_request_chat_template=args.trust_request_chat_template,
                             allowed_origins=args.allowed_origins, chat_template=args.chat_template,
                             generation_config=args.generation_config,
                             override_generation_config=args.override_generation_config)


def run(args) -> int:
    """Bind the port, build the engine, then serve until SIGINT / SIGTERM. A port that cannot be
    bound, a model that cannot load or an engine option the engine refuses is one line on stderr
    and exit code 2 (as `loopjax generate`)."""
    import uvicorn

    from loopjax.engine_args import build_engine, failure_line, with_flag_names

    configure_logging(args.log_level)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:  # e.g. the port is in use
        print(f"loopjax serve: error: cannot bind {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    try:
        model, engine = build_engine(args)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        # a model that cannot load, an option the engine refuses, too little memory (else a bug)
        sock.close()
        if (line := failure_line(e, args)) is None:
            raise
        print(f"loopjax serve: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during the warm-up (uvicorn handles it once serving)
        sock.close()
        print("loopjax serve: interrupted", file=sys.stderr)
        return 130
    # This process serves one engine for its lifetime: what is alive now (the model, the engine,
    # the compile's caches; ~210 k objects with the tiny preset) never becomes garbage, so it
    # leaves the collector's view, and a later full collection (a stall of the engine thread:
    # ~157 ms over those objects on a 2-core CPU, bench/RESULTS.md run 20) scans only what
    # serving created. Not in the library: there an engine may be built and dropped many times,
    # and frozen objects in reference cycles would never be freed.
    gc.freeze()
    if getattr(model, "tokenizer", None) is None:
        log.warning("model has no tokenizer: prompts must be token-id lists and chat is off")
    names = args.served_model_name or [args.model]
    try:
        app = _app(args, model, engine, names)
    except ValueError as e:  # an option create_app refuses (a one-line message naming it, as the flag)
        sock.close()
        line = with_flag_names(str(e), args, APP_OPTIONS)
        print(f"loopjax serve: error: {line}", file=sys.stderr)
        return 2
    # uvicorn turns Ctrl-C into a graceful shutdown; the lifespan then stops the engine thread.
    serving = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    host, port = f"[{args.host}]" if ":" in args.host else args.host, sock.getsockname()[1]
    try:  # NOTE: a server started beside this one may have bound the port too (both bound during
        # the warm-up) and listen first: uvloop's create_server ignores the failing listen() (a server
        # that never answers), so listen here, where it raises
        sock.listen(2048)  # uvicorn's backlog
    except OSError as e:
        print(f"loopjax serve: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    log.info("serving on http://%s:%d (Ctrl-C to quit)", host, port)  # uvicorn logs none for a socket
    try:
        serving.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it served (as uvicorn.run, not an error)
        pass
    return 0 if serving.started else 1
