"""What `loopjax serve` does to its process before it serves."""

from __future__ import annotations

import argparse
import gc

import pytest


def test_serve_freezes_the_heap_it_built(monkeypatch, served_model):
    """After building its engine (warm-up ends with a full collection), `serve` moves every
    object alive into the collector's permanent generation before uvicorn starts, so full
    collections while serving skip the model, the engine and the compile's caches."""
    import uvicorn
    from server_helpers import SERVER_ENGINE

    from loopjax import engine_args, serve_cli, server
    from loopjax.engine import Engine, EngineConfig

    engine = Engine(served_model, EngineConfig(**SERVER_ENGINE, warmup=False))
    frozen_when_serving = []
    monkeypatch.setattr(engine_args, "build_engine", lambda args: (served_model, engine))
    windows = []

    def serve(self, sockets):
        frozen_when_serving.append(gc.get_freeze_count())
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    monkeypatch.setattr(server, "create_app",
                        lambda *a, **kw: windows.append((kw["admission_window_s"], kw["api_key"],
                                                         kw["trust_request_chat_template"],
                                                         kw["allowed_origins"], kw["chat_template"],
                                                         a[1], kw["model_aliases"], kw["generation_config"],
                                                         kw["override_generation_config"])))
    monkeypatch.setenv("LOOPJAX_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    gc.unfreeze()
    try:
        args = parser.parse_args(["ouro-tiny", "--port", "0", "--admission-window-ms", "5",
                                  "--trust-request-chat-template", "--chat-template", "{{ messages }}",
                                  "--served-model-name", "ouro", "alias", "--generation-config", "vllm",
                                  "--override-generation-config", '{"temperature": 0.5}'])
        assert serve_cli.run(args) == 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert frozen_when_serving and frozen_when_serving[0] > 10_000
    # --admission-window-ms reaches the AsyncEngine in seconds; --api-key defaults to $LOOPJAX_API_KEY
    assert windows == [(0.005, "from-env", True, ["*"], "{{ messages }}", "ouro", ("alias",), "vllm",
                        {"temperature": 0.5})]
    assert parser.parse_args(["ouro-tiny", "--api-key", "k"]).api_key == "k"


def test_serve_refuses_a_negative_admission_window(capsys):
    from loopjax import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    # inf and 1e13 (past threading.TIMEOUT_MAX) passed: the AsyncEngine's ValueError was a traceback
    for bad in ("-1", "nan", "x", "inf", "1e13"):
        with pytest.raises(SystemExit):
            parser.parse_args(["ouro-tiny", "--admission-window-ms", bad])
        assert "--admission-window-ms: must be a number in [0, " in capsys.readouterr().err
    assert parser.parse_args(["ouro-tiny"]).admission_window_ms == 0.0
    # vLLM's --override-generation-config: a JSON object of generation_config.json keys, refused at parsing
    for bad, why in (("{temperature: 1}", "not JSON (Expecting property name"), ("[1]", "must be an object"),
                     ('{"max_tokens": 5}', "key 'max_tokens' is not one vLLM reads")):
        with pytest.raises(SystemExit):
            parser.parse_args(["ouro-tiny", "--override-generation-config", bad])
        assert f"--override-generation-config: {why}" in capsys.readouterr().err.replace(
            "override_generation_config ", ""), bad
    # An empty key refused every /v1 request (no client sends one): refused at parsing, and by create_app.
    with pytest.raises(SystemExit):
        parser.parse_args(["ouro-tiny", "--api-key", " "])
    assert "--api-key: must not be empty" in capsys.readouterr().err
    from fake_engine import FakeEngine

    from loopjax.server import create_app
    with pytest.raises(ValueError, match=r"^api_key must be a non-empty str \(None: no key\), got ''$"):
        create_app(FakeEngine(), "m", api_key="")


def test_serve_refuses_a_max_waiting_below_one(capsys):
    """At parsing, not after the engine is built (the AsyncEngine's ValueError was a traceback).
    0 once passed: every request then got a 429 that no retry could pass."""
    from loopjax import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    for bad in ("-1", "0"):
        with pytest.raises(SystemExit):
            parser.parse_args(["ouro-tiny", "--max-waiting", bad])
        assert f"--max-waiting: must be an integer >= 1, got '{bad}'" in capsys.readouterr().err
    assert parser.parse_args(["ouro-tiny", "--max-waiting", "1"]).max_waiting == 1
    from fake_engine import FakeEngine

    from loopjax.async_engine import AsyncEngine
    with pytest.raises(ValueError, match=r"^max_waiting must be an integer >= 1, got 0$"):
        AsyncEngine(FakeEngine(), max_waiting=0)


def test_serve_refuses_a_bad_port_or_log_level_at_parsing(capsys, tmp_path):
    """A port outside 0..65535 (socket.bind's OverflowError) and an unknown log level
    (logging's ValueError) were tracebacks; now argparse's one line, exit code 2."""
    from loopjax import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    for flags, message in ((["--port", "70000"], "--port: must be an integer in [0, 65535], got '70000'"),
                           (["--port", "-1"], "--port: must be an integer in [0, 65535], got '-1'"),
                           (["--log-level", "bogus"], "--log-level: invalid choice: 'bogus'"),
                           (["--allowed-origins", "*"], "--allowed-origins: must be a JSON list of origins"),
                           (["--chat-template", "no/such.jinja"],
                            "--chat-template: cannot read the chat template file 'no/such.jinja'"),
                           (["--host", ""], "--host: must not be empty (0.0.0.0: every interface)"),
                           (["--served-model-name", "tiny", " "], "--served-model-name: must not be empty"),
                           (["--chat-template", "{% if %}"],
                            "--chat-template: chat_template is not a jinja2 template: TemplateSyntaxError")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["ouro-tiny", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    args = parser.parse_args(["ouro-tiny", "--port", "0", "--log-level", "WARNING"])
    assert args.port == 0 and args.log_level == "warning" and args.allowed_origins == ["*"]
    assert parser.parse_args(["ouro-tiny", "--allowed-origins", '["http://a"]']).allowed_origins == ["http://a"]
    # vLLM's --chat-template: a file's text (it was no flag: a checkpoint without a template served no chat)
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert parser.parse_args(["ouro-tiny", "--chat-template", str(template)]).chat_template == (
        "{{ messages[0]['content'] }}")


def test_serve_start_up_errors_are_one_line(monkeypatch, capsys):
    """A model path or preset that does not exist, or an engine option the engine refuses: one
    line on stderr and exit code 2, and nothing served (each was a traceback, exit code 1)."""
    import uvicorn

    from loopjax import serve_cli

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("served after a start-up error"))
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    for argv, expected in ((["/nonexistent/model"], "no model at '/nonexistent/model'"),
                           (["ouro-tyni"], "'ouro-tyni': not a folder and not a preset"),
                           (["ouro-tiny", "--engine-arg", "bogus=1"], "unknown engine option 'bogus'"),
                           (["ouro-tiny", "--engine-arg", "kv_layout=bogus"],
                            "--kv-layout must be one of per_loop, shared, got 'bogus'")):
        assert serve_cli.run(parser.parse_args([*argv, "--port", "0"])) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("loopjax serve: error: ") and expected in err[0], err


def test_an_option_create_app_refuses_is_one_line(monkeypatch, capsys):
    """create_app's ValueError (an option it refuses) was a traceback after the warm-up."""
    import types

    import uvicorn

    from loopjax import engine_args, serve_cli, server

    def refuse(*a, **kw):
        raise ValueError("max_waiting must be an integer >= 1, got 0")

    monkeypatch.setattr(engine_args, "build_engine", lambda args: (types.SimpleNamespace(tokenizer=1), None))
    monkeypatch.setattr(server, "create_app", refuse)
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("served after a start-up error"))
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    gc.unfreeze()
    try:
        assert serve_cli.run(parser.parse_args(["ouro-tiny", "--port", "0"])) == 2
    finally:
        gc.unfreeze()
    # create_app's keyword, named as the flag that sets it
    assert capsys.readouterr().err == "loopjax serve: error: --max-waiting must be an integer >= 1, got 0\n"


def test_serve_refuses_a_port_in_use_before_building_the_engine(monkeypatch, capsys):
    """The port is bound first: a port in use is one line and exit code 2 at once (uvicorn said
    so only after the engine's warm-up, and exited with code 3)."""
    import socket

    from loopjax import engine_args, serve_cli

    monkeypatch.setattr(engine_args, "build_engine", lambda args: pytest.fail("built an engine"))
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert serve_cli.run(parser.parse_args(["ouro-tiny", "--port", str(port)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"loopjax serve: error: cannot bind 127.0.0.1:{port}: Address already in use"]


def test_ctrl_c_during_the_warm_up_is_one_line_exit_130(monkeypatch, capsys):
    """Ctrl-C while the engine compiles (minutes) was a page of JAX traceback; uvicorn handles
    it once serving."""
    from loopjax import engine_args, serve_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_args, "build_engine", interrupted)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.run(parser.parse_args(["ouro-tiny", "--port", "0"])) == 130
    assert capsys.readouterr().err == "loopjax serve: interrupted\n"


def test_out_of_memory_during_the_warm_up_is_one_line(monkeypatch, capsys):
    from loopjax import engine_args, serve_cli

    def out_of_memory(args):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.\nmore")

    monkeypatch.setattr(engine_args, "build_engine", out_of_memory)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.run(parser.parse_args(["ouro-tiny", "--port", "0"])) == 2
    assert capsys.readouterr().err == ("loopjax serve: error: out of memory: RESOURCE_EXHAUSTED: Out of "
                                       "memory allocating 1099511627776 bytes.\n")


def test_serve_refuses_a_port_another_server_listens_on_first(monkeypatch, capsys):
    """Two servers started together both bind the port (neither listens during its warm-up);
    the one that listens second gets one line and exit code 2 (uvloop ignored its failing
    listen(): a server that logged its address and never answered)."""
    import socket
    import types

    import uvicorn
    from fake_engine import FakeEngine

    from loopjax import engine_args, serve_cli

    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as _bind: both bind
    other.bind(("127.0.0.1", 0))
    port = other.getsockname()[1]

    def build(args):  # the other server's warm-up ends first
        other.listen()
        return types.SimpleNamespace(tokenizer=None, cfg=None), FakeEngine()

    monkeypatch.setattr(engine_args, "build_engine", build)
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("served a port in use"))
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    gc.unfreeze()
    try:
        with other:
            assert serve_cli.run(parser.parse_args(["fake", "--port", str(port)])) == 2
    finally:
        gc.unfreeze()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"loopjax serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("level, library_info, loopjax_info", [("info", False, True), ("debug", True, True),
                                                               ("error", False, False)])
def test_serve_log_level_leaves_other_libraries_at_warning(level, library_info, loopjax_info):
    """`--log-level info` (the default) set the root logger to INFO, so each start printed orbax's
    and absl's checkpoint-restore chatter and jax's TPU probe (a dozen INFO lines); now the level
    is loopjax's, other libraries log from WARNING (everything with `debug`)."""
    import logging

    from loopjax import serve_cli

    root, ours = logging.getLogger(), logging.getLogger("loopjax")
    saved = root.level, ours.level
    try:
        serve_cli.configure_logging(level)
        assert logging.getLogger("orbax.checkpoint").isEnabledFor(logging.INFO) is library_info
        assert logging.getLogger("loopjax.server").isEnabledFor(logging.INFO) is loopjax_info
        assert logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.WARNING) is (level != "error")
    finally:
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
