"""A disaggregated decode instance: continuous batching, one step at a time.

A step takes the cost model's `decode_step_s(batch, context tokens)` for the batch as it
is when the step starts; requests that arrive meanwhile join at the next step boundary.
Every running request gets one token per step.
"""

from __future__ import annotations

from collections.abc import Callable

from mooncake.core.cost_model import DecodeModel
from mooncake.sim.loop import EventLoop
from mooncake.sim.request import SimRequest

Hook = Callable[[SimRequest], None]


class DecodeWorker:
    def __init__(
        self, iid: str, loop: EventLoop, model: DecodeModel, on_join: Hook, on_done: Hook
    ) -> None:
        self.id = iid
        self.loop = loop
        self.model = model
        self.on_join = on_join
        self.on_done = on_done
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []
        self.context = 0  # summed context of the running batch
        self.stepping = False
        self.steps = 0

    def join(self, req: SimRequest) -> None:
        self.joining.append(req)
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        for r in self.joining:
            self.on_join(r)
            self.running.append(r)
            self.context += r.context
        self.joining.clear()
        if not self.running:
            self.stepping = False
            return
        self.stepping = True
        self.steps += 1
        self.loop.after(self.model.decode_step_s(len(self.running), self.context), self._stepped)

    def _stepped(self) -> None:
        self.running, self.context = emit_tokens(
            self.running, self.context, self.loop.now, self.on_done
        )
        self._step()


def emit_tokens(
    running: list[SimRequest], context: int, now: float, on_done: Callable[[SimRequest], None]
) -> tuple[list[SimRequest], int]:
    """One decode step: every running request emits a token; finished ones leave (and
    release their context). Returns the requests still running and the batch's context."""
    context += len(running)
    keep: list[SimRequest] = []
    for r in running:
        if r.token(now):
            r.finished_at = now
            context -= r.context
            on_done(r)
        else:
            keep.append(r)
    return keep, context
