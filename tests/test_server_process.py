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

    from loopjax import engine_args, server
    from loopjax.engine import Engine, EngineConfig

    engine = Engine(served_model, EngineConfig(**SERVER_ENGINE, warmup=False))
    frozen_when_serving = []
    monkeypatch.setattr(engine_args, "build_engine", lambda args: (served_model, engine))
    windows = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: frozen_when_serving.append(gc.get_freeze_count()))
    monkeypatch.setattr(server, "create_app", lambda *a, **kw: windows.append(kw["admission_window_s"]))
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    gc.unfreeze()
    try:
        assert server.run(parser.parse_args(["ouro-tiny", "--admission-window-ms", "5"])) == 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert frozen_when_serving and frozen_when_serving[0] > 10_000
    assert windows == [0.005]  # --admission-window-ms reaches the AsyncEngine in seconds


def test_serve_refuses_a_negative_admission_window(capsys):
    from loopjax import server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["ouro-tiny", "--admission-window-ms", bad])
        assert "--admission-window-ms: must be a number >= 0" in capsys.readouterr().err
    assert parser.parse_args(["ouro-tiny"]).admission_window_ms == 0.0


def test_serve_refuses_a_negative_max_waiting(capsys):
    """At parsing, not after the engine is built (the AsyncEngine's ValueError was a traceback)."""
    from loopjax import server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["ouro-tiny", "--max-waiting", "-1"])
    assert "--max-waiting: must be an integer >= 0, got '-1'" in capsys.readouterr().err
    assert parser.parse_args(["ouro-tiny", "--max-waiting", "0"]).max_waiting == 0


def test_serve_start_up_errors_are_one_line(monkeypatch, capsys):
    """A model path or preset that does not exist, or an engine option the engine refuses: one
    line on stderr and exit code 2, and nothing served (each was a traceback, exit code 1)."""
    import uvicorn

    from loopjax import server

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("served after a start-up error"))
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    for argv, expected in ((["/nonexistent/model"], "no model at '/nonexistent/model'"),
                           (["ouro-tyni"], "'ouro-tyni': not a folder and not a preset"),
                           (["ouro-tiny", "--engine-arg", "bogus=1"], "unexpected keyword argument 'bogus'"),
                           (["ouro-tiny", "--kv-layout", "bogus"], "unknown kv layout 'bogus'")):
        assert server.run(parser.parse_args(argv)) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("loopjax serve: error: ") and expected in err[0], err
