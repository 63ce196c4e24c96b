"""Helpers of the engine tests: greedy sampling params and stepping an engine to the end."""

from __future__ import annotations

from loopjax.sampling_params import SamplingParams


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(engine, arrivals=None):
    """Step until done; arrivals {step: [(prompt, params, id)]} are added before that step.
    Returns {id: final RequestOutput}."""
    arrivals = dict(arrivals or {})
    finals, step = {}, 0
    while engine.has_unfinished() or arrivals:
        for prompt, params, rid in arrivals.pop(step, []):
            engine.add_request(prompt, params, rid)
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    return finals


def run_requests(engine, requests):
    """run_all with every request {id: (prompt, params)} added before the first step."""
    return run_all(engine, {0: [(prompt, params, rid) for rid, (prompt, params) in requests.items()]})
