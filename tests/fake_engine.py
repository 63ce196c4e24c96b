"""A fake Engine for the AsyncEngine and server tests: behaviour exact, no JAX, no compile.

One token per step per request (token = previous + 1), one page each; it has the Engine's
add_request / abort / shares_prefix / step / has_unfinished / stats methods (async_engine.py's contract)
and records which threads called it. Knobs: `fail_at_step` (that step raises, as a broken
device would), `lose_token` (a step that would give a request a token it accepts raises the
Engine's StepFailedError: every running request lost and reported aborted by the next step, a
fresh state made unless `recovered` is False), `paused` (the loop accepts requests but never
steps), `gate` (an Event that step() waits for)."""

from __future__ import annotations

import threading
import time
import types

from loopjax.request import StepFailedError


class FakeEngine:
    """Exact stand-in: one token per step per request (token = previous + 1), 1 page each."""

    def __init__(self, fail_at_step=None, lose_token=None):
        self.requests, self.steps, self.fail_at_step, self.lose_token = {}, 0, fail_at_step, lose_token
        self.recovered, self.lost = True, []  # lost: request ids the next step reports aborted
        self.thread_ids = set()
        self.paused = False  # while set, the loop accepts requests but never steps
        self.gate = None  # a threading.Event step() waits for, when set

    def add_request(self, prompt_ids, params, request_id=None):
        self.thread_ids.add(threading.get_ident())
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = types.SimpleNamespace(last=prompt_ids[-1], ids=[], max=params.max_tokens)
        return request_id

    def abort(self, request_id):
        self.requests.pop(request_id)

    def shares_prefix(self, params):
        """Engine.shares_prefix: the prefix cache on (a test gives `scheduler.config`), not adaptive."""
        config = getattr(getattr(self, "scheduler", None), "config", None)
        return bool(getattr(config, "enable_prefix_caching", False)) and not params.stops_adaptively

    def has_unfinished(self):
        return bool(self.requests or self.lost) and not self.paused

    def stats(self):
        return {"queue_len": 0, "running_rows": len(self.requests), "pages_used": len(self.requests),
                "pages_free": 100 - len(self.requests)}

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.steps == self.fail_at_step:
            raise RuntimeError("device fell over")
        if self.lose_token and any(self.lose_token(r.last + 1) for r in self.requests.values()):
            lost, self.requests = list(self.requests), {}
            self.lost += lost
            raise StepFailedError(f"a step failed on the device; {len(lost)} lost", lost, self.recovered)
        outs = [types.SimpleNamespace(request_id=rid, new_token_ids=[], token_ids=[], finished=True,
                                      finish_reason="abort") for rid in self.lost]
        self.lost = []
        time.sleep(0.002)
        for rid, r in list(self.requests.items()):
            r.last += 1
            r.ids.append(r.last)
            done = len(r.ids) == r.max
            outs.append(types.SimpleNamespace(request_id=rid, new_token_ids=[r.last], token_ids=list(r.ids),
                                              finished=done, finish_reason="length" if done else None,
                                              stop_reason=None, exit_loops=[4] * len(r.ids), logprobs=None,
                                              top_logprobs=None,
                                              metrics={"num_submissions": len(r.ids)}))
            if done:
                del self.requests[rid]
        return outs
