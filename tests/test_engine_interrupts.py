"""Engine.step() interrupted at random (an exception while a step is dispatched, or while the
host waits for one's result) over the random workloads of tests/test_engine_host.py on the fake
device: a plan whose dispatch raised never ran and its requests end as aborted, a step not yet
read stays queued for the next step(); the token and carry slots and the pages stay
consistent after every step, and every request that was not aborted gets its tokens alone."""

from __future__ import annotations

import dataclasses
import random

from test_engine_host import _engine, _run, _workload, models  # noqa: F401 (models: a fixture)

from loopjax.engine import EngineConfig


class Interrupt(Exception):
    pass


def _run_interrupted(engine, items, rng, rate):
    """Step to the end while dispatch and read raise at `rate` (before the fake device runs,
    resp. after it ran); aborts too. Returns ({id: final output}, interruptions)."""
    device, arrivals, finals = engine.runner, {}, {}
    dispatch, read, interruptions = device.dispatch, device.read, []

    def flaky(call, name):
        def wrapped(*args, **kwargs):
            if rng.random() < rate:
                interruptions.append(name)
                raise Interrupt(name)
            return call(*args, **kwargs)
        return wrapped
    device.dispatch, device.read = flaky(dispatch, "dispatch"), flaky(read, "read")
    for at, rid, prompt, params, extra in items:
        arrivals.setdefault(at, []).append((rid, prompt, params, extra))
    step = 0
    while engine.has_unfinished() or arrivals:
        assert step < 5000, "not done"
        for rid, prompt, params, extra in arrivals.pop(step, []):
            engine.add_request(prompt, params, rid, **extra)
        if engine.scheduler.requests and rng.random() < 0.05:
            assert engine.abort(rng.choice(sorted(engine.scheduler.requests)))
        try:
            outputs = engine.step()
        except Interrupt:
            outputs = []
        for out in outputs:
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.block_manager.check(engine.scheduler.requests.values())
        for kind, free in (("token_slot", engine._free_token_slots), ("carry_slot", engine._free_carry)):
            held = [getattr(x, kind) for x in engine._extra.values() if getattr(x, kind) is not None]
            assert sorted(held + free) == list(range(engine.runner.max_rows)), kind
        step += 1
    device.dispatch, device.read = dispatch, read
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"] and not engine._extra
    return finals, interruptions


def test_interrupted_steps_keep_slots_pages_and_tokens(models):  # noqa: F811
    kinds = set()
    for seed in range(12):
        try:
            kinds |= set(_scenario(models, seed))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    assert kinds == {"dispatch", "read"}


def _scenario(loaded: dict, seed: int) -> list[str]:
    rng = random.Random(seed)
    family = rng.choice(["ouro", "huginn"])
    model = loaded[family]
    page_size, ctx, fused = rng.choice([1, 2, 4]), rng.randint(6, 24), rng.random() < 0.7
    shared = family == "ouro" and fused and rng.random() < 0.4  # Ouro's decode pages
    config = EngineConfig(page_size=page_size, max_num_rows=rng.choice([1, 3, 4]), max_context_len=ctx,
                          max_prefill_tokens=rng.choice([1, 3, 8, 32]),
                          prefill_token_buckets=(1, 2, 4, 8, 16, 32), max_prefill_rows=rng.choice([1, 2]),
                          fused_decode=fused, max_loops=8, max_logprobs=2,
                          kv_layout="shared" if shared else "per_loop")
    min_pages = -(-ctx // page_size)
    engine = _engine(model, dataclasses.replace(
        config, num_pages=rng.choice([200, rng.randint(min_pages, min_pages + 2)]),
        enable_prefix_caching=rng.random() < 0.6, async_scheduling=rng.random() < 0.7))
    items = _workload(rng, family, ctx, fused, model.cfg.vocab_size, getattr(model.cfg, "hidden_size", 0))
    finals, interruptions = _run_interrupted(engine, items, rng, rate=0.1)
    assert set(finals) == {rid for _, rid, *_ in items}
    alone = _engine(model, dataclasses.replace(config, num_pages=200, async_scheduling=False))
    for _, rid, prompt, params, extra in items:
        expected, out = _run(alone, [(0, rid, prompt, params, extra)])[rid], finals[rid]
        if extra.get("warm_start") and out.metrics["num_preemptions"]:
            continue  # its decoded tokens were recomputed from the prompt's s0 rule (docs/semantics.md)
        n = len(out.token_ids) if out.finish_reason == "abort" else len(expected.token_ids)
        assert (out.token_ids, out.exit_loops) == (expected.token_ids[:n], expected.exit_loops[:n]), rid
        if out.finish_reason != "abort":
            assert (out.finish_reason, out.text, out.logprobs) == (expected.finish_reason, expected.text,
                                                                   expected.logprobs), rid
    return interruptions
