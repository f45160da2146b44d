"""A cost model that corrects itself from the timings the running system reports (pure).

The Conductor predicts TTFT and TBT with a cost model (core/cost_model.py): a profile of
the serving engine, or the analytic reference hardware. Neither describes the hardware as
it runs now - the profile was taken once, on an idle machine; the reference is another
machine. `OnlineCostModel` refits the same polynomial (`fit_prefill`, `fit_decode`: the
non-negative least squares of the profile fit, so the physics the fit keeps holds here too)
to what the workers report:

- prefill: each `request.prefilled` event's (prompt tokens, cached tokens, prefill seconds);
- decode: each decode load report's mean step over its period (batch, context tokens,
  seconds per step), one sample per report, with the number of steps it averages.

The rows it fits are the seed's samples (a profile's, kept for good: they span sizes the
traffic may not, so the fit does not extrapolate from a narrow band) plus a sliding window
of the latest observations. It refits every `refit_every` observations, and at once after
one its prediction missed by more than 25 % (a slow machine shows in the next admission,
not eight prefills later; on this 2-core CPU a replay of 100 requests sees 10 - 20).
Before it has any fit it answers with the seed. With a profile (or a worker's timings of its
engine at start, `calibrated`), it fits from the first observation: those measured rows
anchor it; while they are few, in the FLOPs shape of PAPER.md §4 (`shaped_prefill`). With
only the analytic model (no rows), once `min_samples` observations cover a spread of sizes
(`min_spread`: the largest new-token count, or batch, at least that many times the
smallest), so a run of equal prompts never becomes a flat model that calls a long prompt as
cheap as a short one.

What it does not guard against (stated, not hidden): a model that has become pessimistic
rejects the requests that would correct it; it recovers only through the requests it still
admits (shorter prompts, lighter batches) and through the window sliding as they finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncake.core import cluster as cl
from mooncake.core.cost_model import (
    DecodeModel,
    PolyFit,
    PrefillModel,
    Sample,
    decode_features,
    fit_decode,
    fit_nonnegative,
    fit_prefill,
    load_s_per_token,
    poly_prefill_s,
)

Predictor = Callable[[float, float], float]  # (prompt, cached) or (batch, context) -> s


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    window: int = 256  # latest observations per stage
    min_samples: int = 8  # observations before a fit replaces a seed that has no rows
    min_spread: float = 2.0  # and the spread of sizes they must cover
    refit_every: int = 8  # observations between refits (at once when one is 25 % off)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.refit_every < 1:
            raise ValueError("window, min_samples and refit_every are >= 1")
        if self.min_spread < 1:
            raise ValueError("min_spread is >= 1")


class _Stage:
    """One stage's rows and fit (prefill: x = prompt, z = cached; decode: batch, context)."""

    def __init__(
        self,
        prior: Sequence[Sample],
        fit: Callable[[Sequence[Sample]], Predictor],
        cfg: OnlineSettings,
    ) -> None:
        self.prior = list(prior)
        self.window: deque[tuple[Sample, float]] = deque(maxlen=cfg.window)  # (row, weight)
        self.fitter = fit
        self.cfg = cfg
        self.fit: Predictor | None = None
        self.since = 0
        self.refits = 0
        self.observed = 0
        self.last_error: float | None = None  # observed / predicted, latest sample

    def size(self, row: Sample) -> float:
        raise NotImplementedError

    def ready(self) -> bool:
        if self.prior:
            return bool(self.window)
        if len(self.window) < self.cfg.min_samples:
            return False
        sizes = [self.size(r) for r, _ in self.window]
        small = min(sizes)
        return small > 0 and max(sizes) >= self.cfg.min_spread * small

    def observe(self, row: Sample, weight: float, predicted: float) -> bool:
        self.window.append((row, weight))
        self.observed += 1
        self.since += 1
        if predicted > 0:
            self.last_error = row[2] / predicted
        off = self.last_error is not None and not 0.8 <= self.last_error <= 1.25
        if self.since < self.cfg.refit_every and self.fit is not None and not off:
            return False
        if not self.ready():
            return False
        self.since = 0
        self.fit = self.fitter(self.rows())
        self.refits += 1
        return True

    def anchor(self, rows: Sequence[Sample]) -> bool:
        """Measured rows of the engine (a worker's timings at start) join the prior, the
        newest `PRIOR_CAP` kept; the stage refits at once. False when there were none."""
        if not rows:
            return False
        self.prior = [*self.prior, *rows][-PRIOR_CAP:]
        self.fit = self.fitter(self.rows())
        self.refits += 1
        self.since = 0
        return True

    def rows(self) -> list[Sample]:
        # A decode report that averages k steps counts as k rows (capped: one busy period
        # must not drown the rest of the window).
        out = list(self.prior)
        for row, weight in self.window:
            out.extend([row] * max(1, min(int(weight), 8)))
        return out


PRIOR_CAP = 64  # measured rows kept as the anchor (a profile's, or workers' timings)
FULL_FIT_SIZES = 6  # distinct sizes before prefill rows fit the whole polynomial
# ... and before they fit the attention term's weight (a worker's calibration has 3).
SHAPE_FREE_SIZES = 3


def full_prefill(rows: Sequence[Sample], load_per_token: float = 0.0) -> Predictor:
    fit = fit_prefill(rows, load_per_token)
    return lambda prompt, cached: poly_prefill_s(fit, prompt, cached)


def full_decode(rows: Sequence[Sample]) -> Predictor:
    fit = fit_decode(rows)
    return lambda batch, context: fit(decode_features(batch, context))


def shaped_prefill(
    attention_per_token: float | None, load_per_token: float = 0.0
) -> Callable[[Sequence[Sample]], Predictor]:
    """Prefill fits that keep the FLOPs' shape while the rows are few. PAPER.md §4 counts
    l*(a*n²*d + b*n*d²) FLOPs for n tokens (a = 4, b = 22), so with a cached prefix P of L,
    time ~ c0 + c1 * ((L - P) + k * (L² - P²)) with k = a / (b * d), from the model's hidden
    size d alone. Two timings (a worker's calibration) fix c0 and c1; the whole polynomial
    fits two rows exactly with whichever two of its terms come first, and on SmolLM2
    (d = 576: the attention term is 2.6x the rest at 8,192 tokens) missed an 8 k-token
    prefill by 2.7x (tests/unit/test_online_cost.py). From `SHAPE_FREE_SIZES` distinct
    counts of new tokens (a worker's calibration times three), the attention term's weight
    is fitted too (c0 + c1 * (L - P) + c3 * (L² - P²)): where the GEMMs run on faster units
    than the attention, the FLOPs' k is too small. From `FULL_FIT_SIZES` distinct sizes on,
    the whole polynomial (`full_prefill`). Either way loading a cached token costs the
    seed's `load_per_token` (`cost_model.load_s_per_token`; 0 without a profile), not a
    refitted one, and a prediction is the best reuse of the prefix (`poly_prefill_s`)."""

    def fitter(rows: Sequence[Sample]) -> Predictor:
        sizes = {(x, z) for x, z, _ in rows}
        if attention_per_token is None or len(sizes) >= FULL_FIT_SIZES:
            return full_prefill(rows, load_per_token)
        k = attention_per_token
        seconds = [t - load_per_token * z for x, z, t in rows]
        new_sizes = {x - z for x, z in sizes}
        if len(new_sizes) >= SHAPE_FREE_SIZES:
            # Enough sizes to see the curve: the attention term's own weight, not the FLOPs'
            # (bfloat16 GEMMs on AMX run ~4x faster than the attention beside them, so the
            # FLOPs' share called a 3,000-token prompt ~2x cheaper than it ran: issue 42).
            free = fit_nonnegative([(1.0, x - z, x * x - z * z) for x, z, _ in rows], seconds)
            c0, c1, c3 = free.coef
            poly = PolyFit((c0, c1, 0.0, c3, load_per_token), free.rmse, free.samples)
            return lambda prompt, cached: poly_prefill_s(poly, prompt, cached)

        def work(prompt: float, cached: float) -> float:
            return (prompt - cached) + k * (prompt * prompt - cached * cached)

        fit = fit_nonnegative([(1.0, work(x, z)) for x, z, _ in rows], seconds)
        c0, c1 = fit.coef
        poly = PolyFit((c0, c1, 0.0, c1 * k, load_per_token), fit.rmse, fit.samples)
        return lambda prompt, cached: poly_prefill_s(poly, prompt, cached)

    return fitter


def attention_per_token(hidden: int) -> float:
    """k = a / (b * d) of `shaped_prefill` (PAPER.md §4: a = 4, b = 22)."""
    return 4.0 / (22.0 * hidden)


class _Prefill(_Stage):
    def size(self, row: Sample) -> float:
        return row[0] - row[1]  # new tokens


class _Decode(_Stage):
    def size(self, row: Sample) -> float:
        return row[0]  # batch


class OnlineCostModel:
    """`PrefillModel` and `DecodeModel` (core/cost_model.py) that refit from observations.

    Mutable: the live Conductor owns one and feeds it; everything that predicts through
    `Costs` (Algorithm 1, the admission policies) sees the latest fit."""

    def __init__(
        self,
        seed_prefill: PrefillModel,
        seed_decode: DecodeModel,
        *,
        prefill_prior: Sequence[Sample] = (),
        decode_prior: Sequence[Sample] = (),
        settings: OnlineSettings = OnlineSettings(),
        hidden: int | None = None,
    ) -> None:
        """`hidden`: the served model's hidden size, for the shape of a prefill fit while
        its rows are few (`shaped_prefill`); None fits the whole polynomial from the start."""
        self.seed_prefill, self.seed_decode = seed_prefill, seed_decode
        self.settings = settings
        k = attention_per_token(hidden) if hidden else None
        load = load_s_per_token(seed_prefill)
        self._pre = _Prefill(prefill_prior, shaped_prefill(k, load), settings)
        self._dec = _Decode(decode_prior, full_decode, settings)

    # --- predictions (the protocols) -----------------------------------------------------

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        fit = self._pre.fit
        if fit is None:
            return self.seed_prefill.prefill_s(prompt_tokens, cached_tokens)
        prompt = float(max(prompt_tokens, 0))
        cached = float(min(max(cached_tokens, 0), max(prompt_tokens, 0)))
        return fit(prompt, cached)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        fit = self._dec.fit
        if fit is None:
            return self.seed_decode.decode_step_s(batch, context_tokens)
        return fit(float(max(batch, 0)), float(max(context_tokens, 0)))

    # --- observations ----------------------------------------------------------------------

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> bool:
        """One prefill as it ran; True when it triggered a refit. Nonsense is ignored."""
        if prompt_tokens < 1 or not 0 <= cached_tokens <= prompt_tokens or not seconds > 0:
            return False
        predicted = self.prefill_s(prompt_tokens, cached_tokens)
        row = (float(prompt_tokens), float(cached_tokens), float(seconds))
        return self._pre.observe(row, 1.0, predicted)

    def observe_decode(
        self, batch: float, context_tokens: float, step_s: float, steps: int = 1
    ) -> bool:
        """The mean decode step over `steps` steps of a batch of (mean) `batch` sequences
        holding (mean) `context_tokens` of KV; True when it triggered a refit."""
        if not batch > 0 or context_tokens < 0 or not step_s > 0 or steps < 1:
            return False
        predicted = self.decode_step_s(round(batch), round(context_tokens))
        return self._dec.observe((float(batch), float(context_tokens), step_s), steps, predicted)

    def calibrated(self, prefill: Sequence[Sample] = (), decode: Sequence[Sample] = ()) -> bool:
        """A worker's engine timings at start: measured rows, kept as the fit's anchor."""
        ok = [r for r in prefill if r[0] >= 1 and 0 <= r[1] <= r[0] and r[2] > 0]
        good = [r for r in decode if r[0] >= 1 and r[1] >= 0 and r[2] > 0]
        a = self._pre.anchor(ok)
        b = self._dec.anchor(good)
        return a or b

    # --- state, for metrics and the decision record ----------------------------------------

    @property
    def prefill_calibrated(self) -> bool:
        """Whether prefill predictions rest on measurements of the serving engine: a
        profile's rows (a seed the operator measured) or a fit to this cluster's timings."""
        return bool(self._pre.prior) or self._pre.fit is not None

    def error(self, stage: str) -> float | None:
        """Observed / predicted seconds of the latest timing of `stage` ("prefill" or
        "decode"); None before one."""
        return (self._pre if stage == "prefill" else self._dec).last_error

    @property
    def refits(self) -> int:
        return self._pre.refits + self._dec.refits

    def state(self) -> dict[str, float]:
        """Numbers to record with a decision: refits and observations per stage, whether
        each stage answers from a fit (1) or its seed (0), the latest observed/predicted."""
        out: dict[str, float] = {}
        for name, st in (("prefill", self._pre), ("decode", self._dec)):
            out[f"cost_{name}_refits"] = float(st.refits)
            out[f"cost_{name}_observed"] = float(st.observed)
            out[f"cost_{name}_fitted"] = 1.0 if st.fit is not None else 0.0
            if st.last_error is not None:
                out[f"cost_{name}_error"] = st.last_error
        return out


def observe_fact(model: OnlineCostModel, fact: cl.Fact) -> str | None:
    """Feed a view fact's timing to `model`, if it carries one; the stage ("prefill" or
    "decode") it was a sample of, else None."""
    match fact:
        case cl.PrefillFinished(prompt_tokens=n, cached_tokens=c, seconds=t) if (
            n is not None and t is not None
        ):
            model.observe_prefill(n, c, t)
            return "prefill"
        case cl.DecodeLoadReported(steps=k, step_s=t, step_batch=b, step_context_tokens=c) if (
            k > 0 and t is not None and b is not None and c is not None
        ):
            model.observe_decode(b, c, t, k)
            return "decode"
        case cl.EngineCalibrated(role="prefill", samples=rows):
            return "prefill" if model.calibrated(prefill=rows) else None
        case cl.EngineCalibrated(role="decode", samples=rows):
            return "decode" if model.calibrated(decode=rows) else None
    return None
