"""Start-up compiles: every executable the runner builds is timed (lowering, XLA compile) and
counted once; `EngineConfig.compilation_cache_dir` makes a second process load the
executables from JAX's persistent cache instead of compiling them, with the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import loopjax
from loopjax.compilation import compile_lowered
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams
from loopjax.steps import fused

# Two decode row buckets and one prefill bucket: a few small executables.
SMALL = dict(page_size=8, max_num_rows=2, decode_row_buckets=(1, 2), max_prefill_tokens=16,
             prefill_token_buckets=(16,), max_prefill_rows=2, max_context_len=32, verbose=False)


@pytest.fixture(scope="module")
def model():
    return loopjax.load("ouro-tiny")


def test_every_compiled_executable_is_timed_once(model, no_compilation_cache):
    engine = Engine(model, EngineConfig(**SMALL, strict_compile=True))
    runner, times = engine.runner, engine.runner.compile_times
    # decode rows 1 and 2, each with the full and the greedy sampler; prefill 2 x 16
    assert runner.compilations == len(times) == 5
    assert all(t.lower_s > 0 and t.compile_s > 0 and not t.cache_hit for t in times)
    # lowered (and timed) the likely longest compiles first: the prefill step, then decode
    assert [t.decode for t in times] == [False, True, True, True, True]
    labels = sorted(t.label for t in times)
    assert labels == ["decode rows=1 width=4 loops=4", "decode rows=1 width=4 loops=4 greedy",
                      "decode rows=2 width=4 loops=4", "decode rows=2 width=4 loops=4 greedy",
                      "prefill rows=2 tokens=16 width=4 loops=4"]
    assert all(t.kind == fused(4, greedy=t.decode and t.kind.greedy) for t in times)
    stats = engine.stats()
    assert stats["compile_s"] == pytest.approx(sum(t.lower_s + t.compile_s for t in times))
    assert stats["compile_cache_hits"] == 0


def test_a_step_compiled_after_start_up_is_timed_too(model):
    """Without warm-up the runner compiles on first use: each compile still gets its entry."""
    engine = Engine(model, EngineConfig(**SMALL, warmup=False))
    assert engine.runner.compile_times == [] and engine.stats()["compile_s"] == 0
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    times = engine.runner.compile_times
    assert len(times) == engine.runner.compilations == 2  # the prefill and the 1-row decode
    assert {t.label for t in times} == {"prefill rows=2 tokens=16 width=4 loops=4",
                                       "decode rows=1 width=4 loops=4 greedy"}
    assert all(t.seconds > 0 for t in times)


def test_each_compile_starts_while_later_steps_still_lower():
    """compile_lowered takes each step as the runner lowers it: the second step is lowered
    (yielded) only once the first one's compile has started in a worker thread."""
    started = threading.Event()

    class Lowered:  # a jax Lowered stand-in
        def __init__(self, name, on_compile=None):
            self.name, self.on_compile = name, on_compile

        def compile(self):
            if self.on_compile:
                self.on_compile.set()
            return self.name

    def lowered():
        yield Lowered("first", on_compile=started)
        assert started.wait(timeout=30), "the first compile had not started"
        yield Lowered("second")

    built = compile_lowered(lowered(), threads=2)
    assert [exe for exe, _, _ in built] == ["first", "second"]
    assert all(seconds >= 0 and not hit for _, seconds, hit in built)


def test_an_interrupt_while_lowering_waits_only_for_running_compiles():
    """Ctrl-C during the warm-up: the compiles queued behind the running one are dropped, not
    run to the end before the interrupt surfaces."""
    ran = []

    class Lowered:
        def compile(self):
            ran.append(self)
            time.sleep(0.3)

    def lowered():
        yield from (Lowered() for _ in range(4))
        raise KeyboardInterrupt  # while lowering the fifth step

    with pytest.raises(KeyboardInterrupt):
        compile_lowered(lowered(), threads=1)
    assert len(ran) == 1  # the running one; three were queued


# A fresh process builds the engine with the cache folder argv[1], generates greedily and
# prints what it saw: JSON on the last line.
CHILD = """
import json, sys
import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams
config = EngineConfig(**json.loads(sys.argv[2]), strict_compile=True, compilation_cache_dir=sys.argv[1])
engine = Engine(loopjax.load("ouro-tiny"), config)
engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), "r")
tokens = []
while engine.has_unfinished():
    tokens += [t for out in engine.step() for t in out.new_token_ids]
times = engine.runner.compile_times
print(json.dumps({"tokens": tokens, "compilations": engine.stats()["compilations"],
                  "cache_hits": engine.stats()["compile_cache_hits"],
                  "hit_flags": [t.cache_hit for t in times], "compile_s": [t.compile_s for t in times]}))
"""


def _start(cache_dir) -> dict:
    config = dict(SMALL, decode_row_buckets=(1,), max_num_rows=1)
    done = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), json.dumps(config)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_the_executables_from_the_compilation_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    first = _start(cache)
    # the 1-row decode with each sampler, the prefill
    assert first["compilations"] == 3 and first["cache_hits"] == 0 and not any(first["hit_flags"])
    # Every step executable was written (the jitted step function is named `traced`).
    def steps():
        return sorted(name for name in os.listdir(cache) if name.startswith("jit_traced"))
    written = steps()
    assert len(written) == first["compilations"]
    second = _start(cache)
    assert second["cache_hits"] == second["compilations"] == 3 and all(second["hit_flags"])
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 6
    assert steps() == written  # nothing was compiled anew


def test_the_cache_folder_is_an_engine_flag():
    import argparse

    from loopjax.engine_args import add_engine_arguments, engine_config_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert "--compilation-cache-dir" in parser.format_help()
    args = parser.parse_args(["--compilation-cache-dir", "/tmp/jax-cache"])
    assert engine_config_kwargs(args) == {"compilation_cache_dir": "/tmp/jax-cache"}


def test_a_cache_folder_that_is_a_file_is_refused_by_name(tmp_path):
    """`--compilation-cache-dir FILE` said only "File exists" (os.makedirs'); it is refused before
    JAX's process-wide cache settings change."""
    from loopjax.compilation import use_compilation_cache

    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(ValueError, match=r"^compilation_cache_dir '.*cache' is not a folder$"):
        use_compilation_cache(str(tmp_path / "cache"))


def test_warmup_runs_each_executable_once_and_leaves_the_pool_as_it_was(model, monkeypatch):
    """Warm-up runs every compiled step once (padding rows only, so no request pays an
    executable's first run), then collects garbage in full; padding writes no real KV slot, and
    it is no workload submission."""
    import gc

    import jax
    import numpy as np

    from loopjax.kv_cache import allocate_state
    from loopjax.runner import Runner

    submitted, events = [], []
    real_submit = Runner.submit
    def submit(self, batch, kind):
        events.append("submit")
        submitted.append(self._key(batch, kind))
        return real_submit(self, batch, kind)
    monkeypatch.setattr(Runner, "submit", submit)

    def collected(phase, info):
        if phase == "stop":
            events.append(f"gc{info['generation']}")
    gc.callbacks.append(collected)
    try:
        engine = Engine(model, EngineConfig(**SMALL, strict_compile=True))
    finally:
        gc.callbacks.remove(collected)
    # the warm-up's full collection comes after its last run (none during the first requests)
    assert "gc2" in events[events.index("submit"):] and events[-1] == "gc2"
    runner = engine.runner
    assert sorted(map(str, submitted)) == sorted(map(str, runner._compiled)) and len(submitted) == 5
    assert runner.submissions == 0
    pool = jax.tree_util.tree_leaves(runner.state.kv)
    assert len(pool) == 2 * model.cfg.num_layers
    for cache in pool:  # every slot of the pool belongs to some request: still zero
        assert not np.any(np.asarray(cache, np.float32))
    fresh = allocate_state(model.cfg, engine.layout, SMALL["max_num_rows"], pool[0].dtype)
    carry, fresh_carry = (jax.tree_util.tree_leaves(c) for c in (runner.state.carry, fresh.carry))
    for value, before in zip(carry, fresh_carry, strict=True):  # the requests' carry slots: untouched
        if np.ndim(value) and value.shape[0] == SMALL["max_num_rows"] + 1:
            np.testing.assert_array_equal(np.asarray(value)[:-1], np.asarray(before)[:-1])
    assert any(np.ndim(v) and v.shape[0] == SMALL["max_num_rows"] + 1 for v in carry)


def test_a_strict_engine_serves_greedy_then_sampled_then_greedy_without_compiling(model, monkeypatch):
    """Warm-up builds both samplers of every decode bucket: decode steps of greedy requests run
    the greedy executable, a step with a sampled row the full one, and nothing compiles."""
    from loopjax.runner import Runner

    engine = Engine(model, EngineConfig(**SMALL, strict_compile=True))
    compiled, greedy_steps = engine.runner.compilations, []  # per request: its decode kinds' greedy
    real_submit = Runner.submit
    monkeypatch.setattr(Runner, "submit", lambda self, batch, kind: (
        batch.decode and greedy_steps[-1].add(kind.greedy)) or real_submit(self, batch, kind))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for params in (greedy, SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=1), greedy):
        greedy_steps.append(set())
        engine.add_request([1, 2, 3], params)
        while engine.has_unfinished():
            engine.step()
    assert greedy_steps == [{True}, {False}, {True}]
    assert engine.runner.compilations == compiled
