"""How the Engine ends requests when a step fails or is interrupted (a mixin of engine.Engine,
whose module note states the contracts). Each handler ends the requests it must, gives their
token and carry slots back first (so a second interrupt cannot keep them), then queues their
outputs for the next step() to report (`Engine._aborted`):
- a dispatch that raised (Ctrl-C while a step compiles): the plan never ran, its requests are
  aborted (`_drop_dispatch`);
- an update that raised (Ctrl-C while it decodes text): it applied its rows up to the one that
  raised, and those outputs are reported; that row and the later ones are aborted, their text
  decoded anew from their tokens, also where the update finished them (`_abandon`);
- a read that raised an Exception (a device error): the steps in flight and maybe the donated
  device state are lost; every admitted request is aborted, the prefix cache forgotten and the
  state made anew (`_lose_device_state`).
"""

from __future__ import annotations

from loopjax.request import FINISH_ABORT, Request, RequestOutput, StepFailedError
from loopjax.wording import counted


class EngineFailures:
    def _report_ended(self, requests: list[Request]) -> None:
        """Requests ended outside an update: slots back, their outputs for the next step."""
        for request in requests:
            self._release_slots(request)
        self._aborted += [self._output(request, []) for request in requests]

    def _drop_dispatch(self, plan) -> None:
        """The newest plan's dispatch raised: it never ran; its requests are aborted."""
        self._report_ended(self.scheduler.drop(plan))

    def _abandon(self, outputs: list[RequestOutput], requests: list[Request]) -> None:
        """An update raised at the first of `requests` (its rows from there on): `outputs` (of
        the rows before) go to the next step; `requests` are aborted (one the update finished
        too: its text or logprobs may lack the token), their text decoded anew."""
        for request in requests:
            if self.scheduler.abort(request.request_id) is None:  # it finished in this update
                request.finish_reason = FINISH_ABORT
            extra = self._extra.get(request.request_id)
            if extra is not None:
                extra.text = extra.detokenizer = None
        self._aborted = outputs + self._aborted
        self._report_ended(requests)

    def _lose_device_state(self, error: Exception) -> StepFailedError:
        """A step's read raised: drop every step in flight, abort every admitted request (their
        KV went with the donated state; reported by the next step), forget the prefix cache
        and start a fresh device state, so that waiting and new requests run; the error to
        raise, in one line."""
        lost = [r for plan, _ in reversed(self._in_flight) for r in self.scheduler.drop(plan)]
        self._in_flight.clear()
        lost += [self.scheduler.abort(r.request_id) for r in list(self.scheduler.running)]
        self._report_ended(lost)
        self.scheduler.block_manager.forget_cached()
        try:
            self.runner.reset_state()
            recovered, after = True, "the KV pool made anew"
        except Exception as e:  # NOTE: the device is gone; Runner.submit refuses every later step
            recovered, after = False, f"no new KV pool ({type(e).__name__}): build a new engine"
        line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return StepFailedError(f"a step failed on the device ({type(error).__name__}: {line}); "
                               f"{counted(len(lost), 'running request')} aborted, {after}",
                               [r.request_id for r in lost], recovered)
