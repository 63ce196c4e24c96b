"""Engine.step() interrupted at random (an interrupt, as Ctrl-C's, while a step is dispatched or
while the host waits for one's result) over the random workloads of tests/test_engine_host.py
on the fake device: a plan whose dispatch raised never ran and its requests end as aborted, a
step not yet read stays queued for the next step(); a read that fails (a device error, an
Exception) aborts the running requests and the engine serves on. The token and carry slots and
the pages stay consistent after every step, and every request that was not aborted gets its
tokens alone."""

from __future__ import annotations

import random

from test_engine_host import check_alone, check_engine, models, random_scenario  # noqa: F401 (models: a fixture)


class Interrupt(BaseException):  # as Ctrl-C's KeyboardInterrupt: no Exception
    pass


class DeviceError(RuntimeError):
    pass


def _run_interrupted(engine, items, rng, rate, read_error=Interrupt):
    """Step to the end while dispatch and read raise at `rate` (before the fake device runs,
    resp. after it ran; read: `read_error`); aborts too. Returns ({id: final output},
    interruptions)."""
    device, arrivals, finals = engine.runner, {}, {}
    dispatch, read, interruptions = device.dispatch, device.read, []

    def flaky(call, name):
        def wrapped(*args, **kwargs):
            if rng.random() < rate:
                interruptions.append(name)
                raise (read_error if name == "read" else Interrupt)(name)
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
        except RuntimeError as e:  # the engine's one line for a failed read
            assert read_error is not Interrupt and str(e).startswith("a step failed on the device ("), e
            outputs = []
        for out in outputs:
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        check_engine(engine)
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


def test_failed_reads_abort_the_running_requests_and_the_engine_serves_on(models):  # noqa: F811
    kinds = set()
    for seed in range(12):
        try:
            kinds |= set(_scenario(models, seed, read_error=DeviceError, rate=0.05))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    assert "read" in kinds


def _scenario(loaded: dict, seed: int, read_error=Interrupt, rate=0.1) -> list[str]:
    rng = random.Random(seed)
    model, config, engine, items = random_scenario(loaded, rng)
    finals, interruptions = _run_interrupted(engine, items, rng, rate=rate, read_error=read_error)
    check_alone(model, config, items, finals)
    return interruptions
