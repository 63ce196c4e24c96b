"""Session fixtures of the server tests (test_server_*.py, test_openai_protocol.py).

One uvicorn server (in a thread, on a free port) serves the tiny Ouro preset with a small
word-level tokenizer and a ChatML template (tests/server_helpers.py), prefix cache on. It is
built once per session: the engine's start-up compilation dominates these tests' time, and
every server test file shares it. Tests leave it idle and its settings as they found them.
Imports are inside the fixtures: other test files need neither the serve extras nor a server.
"""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(scope="session")
def served_model():
    from server_helpers import CHATML, MODEL_NAME, word_tokenizer

    from loopjax.model import load

    m = load(MODEL_NAME)
    return dataclasses.replace(m, tokenizer=word_tokenizer(m.cfg.vocab_size), chat_template=CHATML)


@pytest.fixture(scope="session")
def server(served_model):
    """The live server; `server.aengine` is its AsyncEngine."""
    from server_helpers import MODEL_NAME, SERVER_ENGINE, LiveServer

    from loopjax.engine import Engine, EngineConfig
    from loopjax.server import create_app

    engine = Engine(served_model, EngineConfig(**SERVER_ENGINE))
    app = create_app(engine, MODEL_NAME, model=served_model)
    with LiveServer(app) as live:
        live.aengine = app.state.async_engine
        yield live
    assert not live.aengine.running  # the lifespan stopped the engine thread


@pytest.fixture(scope="session")
def client(server):
    """The real `openai` client pointed at the live server (no retries)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
