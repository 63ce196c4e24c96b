"""Engine.step() interrupted at random (an interrupt, as Ctrl-C's, while a step is dispatched,
while the host waits for one's result, or in schedule() just after it preempted a request) over
the random workloads of tests/test_engine_host.py on the fake device: a plan whose dispatch
raised never ran and its requests end as aborted, a step not yet read stays queued for the next
step(), a preemption made by a schedule() that raised is reported by the next plan; a read that
fails (a device error, an Exception) aborts the running requests and the engine serves on. The
token and carry slots and the pages stay consistent after every step, and every request that
was not aborted gets its tokens alone."""

from __future__ import annotations

import random

import pytest
from test_engine_host import _engine, check_alone, check_engine, models, random_scenario  # noqa: F401 (models)

from loopjax import EngineConfig, SamplingParams
from loopjax.request import RequestPhase


class Interrupt(BaseException):  # as Ctrl-C's KeyboardInterrupt: no Exception
    pass


class DeviceError(RuntimeError):
    pass


def _run_interrupted(engine, items, rng, rate, read_error=Interrupt):
    """Step to the end while dispatch and read raise at `rate` (before the fake device runs,
    resp. after it ran; read: `read_error`), and so do building a plan's rows, the text decodes
    of a step's update and schedule() after a preemption (an Interrupt); aborts too. Returns
    ({id: final output}, interruptions)."""
    device, arrivals, finals = engine.runner, {}, {}
    dispatch, read, interruptions = device.dispatch, device.read, []

    armed = [True]  # NOTE: one interrupt per step: a second one may hit the engine's handler

    def flaky(call, name):
        def wrapped(*args, **kwargs):
            if armed[0] and rng.random() < rate:
                interruptions.append(name)
                armed[0] = False
                raise (read_error if name == "read" else Interrupt)(name)
            return call(*args, **kwargs)
        return wrapped
    device.dispatch, device.read = flaky(dispatch, "dispatch"), flaky(read, "read")
    engine._row = flaky(engine._row, "row")  # Ctrl-C while the host builds a row of a plan
    tokenizer = engine.model.tokenizer  # this engine's own (test_engine_host._engine)
    decode = tokenizer.decode
    preempt = engine.scheduler._preempt

    def preempt_then_interrupt(*args):  # Ctrl-C in the host's schedule() just after a preemption
        preempt(*args)
        if armed[0] and read_error is Interrupt and rng.random() < 3 * rate:
            interruptions.append("schedule")
            armed[0] = False
            raise Interrupt("schedule")
    engine.scheduler._preempt = preempt_then_interrupt
    for at, rid, prompt, params, extra in items:
        arrivals.setdefault(at, []).append((rid, prompt, params, extra))
    step = 0
    while engine.has_unfinished() or arrivals:
        assert step < 5000, "not done"
        for rid, prompt, params, extra in arrivals.pop(step, []):
            engine.add_request(prompt, params, rid, **extra)
        if engine.scheduler.requests and rng.random() < 0.05:
            assert engine.abort(rng.choice(sorted(engine.scheduler.requests)))
        count = interruptions.count("schedule")
        armed[0], tokenizer.decode = True, flaky(decode, "update")  # Ctrl-C while an update decodes text
        try:
            outputs = engine.step()
        except Interrupt:
            outputs = []
        except RuntimeError as e:  # the engine's one line for a failed read
            assert read_error is not Interrupt and str(e).startswith("a step failed on the device ("), e
            outputs = []
        finally:
            tokenizer.decode = decode
        for out in outputs:
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
        # NOTE: a schedule() that raised left its preemptions to the next plan, which gives their slots back
        check_engine(engine, settled=interruptions.count("schedule") == count)
        step += 1
    device.dispatch, device.read, engine.scheduler._preempt = dispatch, read, preempt
    del engine._row
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
    assert kinds >= {"dispatch", "read", "update", "row"}  # "schedule" too, rarely: its own test below


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


def test_an_interrupt_in_schedule_after_a_preemption_loses_no_slot(models):  # noqa: F811
    """Ctrl-C in schedule() just after it preempted a request: the next plan still reports the
    preemption, so the request gives its token slot back (it kept it until it finished, and
    admissions could find no free slot); both requests then end as they would have."""
    config = EngineConfig(page_size=4, num_pages=4, max_num_rows=2, max_context_len=16, max_prefill_tokens=8,
                          prefill_token_buckets=(8,), max_prefill_rows=2, async_scheduling=False)
    engine, params = _engine(models["ouro"], config), SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request([1, 2, 3], params, "old")
    engine.add_request([4, 5, 6], params, "new")  # preempted when "old" needs its third page
    preempt = engine.scheduler._preempt

    def preempt_then_interrupt(*args):
        preempt(*args)
        raise Interrupt("schedule")
    engine.scheduler._preempt = preempt_then_interrupt
    with pytest.raises(Interrupt):
        for _ in range(20):
            engine.step()
    engine.scheduler._preempt = preempt
    assert engine.scheduler.get("new").phase is RequestPhase.PREEMPTED
    engine.step()
    check_engine(engine)  # "new" waits, holding no slot
    assert engine.scheduler.get("new").phase is RequestPhase.PREEMPTED
    while engine.has_unfinished():
        for out in engine.step():
            assert not out.finished or (out.finish_reason, len(out.token_ids)) == ("length", 12)
        check_engine(engine)
