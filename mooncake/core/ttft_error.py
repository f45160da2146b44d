"""How far the Conductor's TTFT predictions miss, and the margin admission keeps for it (pure).

Every admitted request's TTFT is predicted at admission (queue + transfer + prefill, from
the cost model); the Conductor later sees its prefill end on its own clock. `TtftErrors`
keeps observed / predicted for the latest `window` requests, and `margin(q)` is their
nearest-rank q-quantile: admission judges predicted TTFT x margin against the SLO
(`admission.decide`). With q = 0.9, a request predicted at the SLO / margin would have made
the SLO had it missed like nine in ten of the latest requests did.

Why the cost model's own refit (core/online_cost.py) is not enough: it fits the prefill's
service time, but a TTFT is also the wait behind queued work predicted with older fits, the
contention of other workers on shared cores, and the bus; and every policy admits up to the
SLO line itself, so a model right on average puts half of what it admits over the line.
`bench memory` on this 2-core machine saw predictions 1.19 - 1.33x optimistic at p50, and
goodput 0 in five of six runs, from that alone (docs/history/benchmarks.md).

When the cost model refits, what it would have predicted changes, so the error it would
have made does too: `rescale` divides each kept sample's miss by how much the new model
prices that request's own prefill above its prediction (an approximation: the queue ahead
of it is taken to have changed alike, and a prefix's transfer with it), and
`ClusterView.reestimate` moves the prediction of each request still in flight to its new
predicted prefill end. Otherwise a model refitted to the same slow prefills that made the
margin is judged with that margin on top: live on a 2-vCPU Xeon, a refit from 2.58 to
3.17 s for 3,000 tokens kept the 1.28 it was missing by, and a burst's third request,
predicted at 9.5 s and served at ~9.4, was rejected (12.1 s > 10 s).

A sample is taken only from a prediction the Conductor judged with a calibrated model: the
ones made on the starting seed (the reference hardware, orders of magnitude off) say nothing
about the model that decides now. The margin is clamped to [MIN_MARGIN, MAX_MARGIN], so one
wild stretch (a stalled machine) cannot close admission for good: the window slides only
through requests still admitted, and a margin of 10 still admits what is predicted at a
tenth of the SLO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mooncake.core.quantile import quantile

WINDOW = 64  # latest admitted requests whose prefill ended
MIN_SAMPLES = 4  # before this many, no margin (1.0): a burst admits only a few dozen
MIN_MARGIN, MAX_MARGIN = 0.5, 10.0


@dataclass(slots=True)
class Sample:
    observed_s: float
    predicted_s: float
    # The request's prompt, its cached tokens and its predicted prefill (0: not rescaled).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0


class TtftErrors:
    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples are >= 1")
        self._samples: deque[Sample] = deque(maxlen=window)
        self._min = min_samples
        self._margins: dict[float, float] = {}  # by q, until the next sample

    def __len__(self) -> int:
        return len(self._samples)

    def add(
        self,
        observed_s: float,
        predicted_s: float,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        prefill_s: float = 0.0,
    ) -> None:
        """One request's TTFT as the Conductor saw it against its prediction at admission
        (ignored where either is not a positive time); with its prompt, cached tokens and
        predicted prefill, a refit rescales it (`rescale`)."""
        if observed_s > 0 and predicted_s > 0:
            self._samples.append(
                Sample(observed_s, predicted_s, prompt_tokens, cached_tokens, prefill_s)
            )
            self._margins.clear()

    def rescale(self, prefill_s: Callable[[int, int], float]) -> None:
        """The cost model now prices a prefill at `prefill_s(prompt, cached)`: each sample's
        prediction is what it would have been, scaled by its own prefill's change."""
        for x in self._samples:
            if x.prefill_s > 0 and (new := prefill_s(x.prompt_tokens, x.cached_tokens)) > 0:
                x.predicted_s *= new / x.prefill_s
                x.prefill_s = new
        self._margins.clear()

    def margin(self, q: float) -> float:
        """The q-quantile of observed / predicted, clamped; 1.0 until `min_samples`."""
        if len(self._samples) < self._min:
            return 1.0
        if (m := self._margins.get(q)) is None:
            x = quantile([s.observed_s / s.predicted_s for s in self._samples], q)
            assert x is not None
            m = self._margins[q] = min(max(x, MIN_MARGIN), MAX_MARGIN)
        return m
