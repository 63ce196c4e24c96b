"""Session fixtures: the whole run's compilation cache, and the server tests' live server
(test_server_*.py, test_openai_protocol.py).

One uvicorn server (in a thread, on a free port) serves the tiny Ouro preset with a small
word-level tokenizer and a ChatML template (tests/server_helpers.py), prefix cache on. It is
built once per session: the engine's start-up compilation dominates these tests' time, and
every server test file shares it. Tests leave it idle and its settings as they found them.
Imports are inside the fixtures: other test files need neither the serve extras nor a server.

Every test shares one JAX persistent compilation cache (`compilation_cache`): many tests build
engines of the same tiny configurations, and a hit loads the executable instead of compiling
it again. pytest-xdist's workers (pyproject's addopts) share it too. Tests of compile timing
turn it off (`no_compilation_cache`).

XLA compiles at LLVM -O0 here (XLA_FLAGS, unless it already sets the level): most of the
suite's time is compiling small executables, and the whole suite ran in 741 s instead of
1,084 s on this 2-core machine (session 22). Values may differ from -O2's in the last bit
where a computation is fused differently, as they already do between jitted and eager code:
the suite's bitwise checks compare results compiled under the same flags, and the golden
tests (tokens, and values within their tolerances, against the PyTorch reference) pass at
both levels. The subprocesses of CLI tests inherit it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # NOTE: read when XLA's backend starts, after this module (workers import it first too)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in this run's temporary folder (under pytest-xdist,
    the folder above each worker's own, so that the workers share it)."""
    from loopjax.compilation import use_compilation_cache

    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    # NOTE: no size bound, which would turn on the cache's file lock and a scan of the whole
    # folder at every write (O(entries^2) over a run). Without the lock, a worker may read an
    # entry the other is still writing: JAX then warns and compiles it (a slower test, never
    # a wrong executable: a truncated entry fails to decompress).
    use_compilation_cache(str(run_dir / "jax-compilation-cache"))


@pytest.fixture
def no_compilation_cache():
    """The persistent cache off for one test of compile timing (an earlier test may have
    compiled the same executables), then on again."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    jax_cache.reset_cache()


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
