"""Time predictors for the Conductor (PAPER.md §4): prefill, decode step, KV transfer.

Pure: numbers in, seconds out. Two families share one interface (`PrefillModel`,
`DecodeModel`), so the Conductor, the simulator and the live worker cannot tell them apart:

- `FittedCostModel`: polynomial regressions fitted (numpy least squares) on the engine
  profiler's JSON (`PROFILE_SCHEMA`, see `parse_profile`).
- `AnalyticCostModel`: FLOPs / bytes from the model shape and the hardware, for the paper's
  reference hardware (LLaMA3-70B on 8xA800 and 8xH800) where no profile exists.

Physics the models keep (and the tests check): prefill time never decreases with the prompt
length and never increases with the cached prefix - a prediction is the prefill's with the
best reuse of that prefix, since loading a cached token can cost more than computing it
saves, and `reuse` says how much of it to load; a decode step never gets faster with
a larger batch or a longer context; moving more tokens never takes less time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

PROFILE_SCHEMA = "mooncake.profile/1"


class PrefillModel(Protocol):
    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float: ...


class DecodeModel(Protocol):
    def decode_step_s(self, batch: int, context_tokens: int) -> float: ...


# --- shapes and hardware -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    params: float  # parameter count, for the bytes a decode step streams from HBM

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes (PAPER.md §2)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Hardware:
    """One serving instance (a node of `gpus` GPUs, tensor-parallel). Bandwidths in bytes/s
    for the whole node."""

    name: str
    gpus: int
    peak_flops_per_gpu: float  # dense BF16
    hbm_bytes_per_s_per_gpu: float
    h2d_bytes_per_s: float  # host DRAM -> GPUs, whole node
    nic_bytes_per_s: float  # node <-> node (RDMA), whole node
    # Local NVMe read, whole node. Not in the papers: assumed 4 PCIe Gen4 drives at their
    # ~7 GB/s sequential read (KV blocks are large sequential reads), derated to 6 GB/s each.
    ssd_bytes_per_s: float = 4 * 6e9

    @property
    def peak_flops(self) -> float:
        return self.gpus * self.peak_flops_per_gpu


LLAMA3_70B = ModelShape("llama3-70b", 80, 8192, 8, 128, 2, 70.6e9)  # 320 KiB of KV per token
# PAPER.md §4: 8 x 312 TFLOPS BF16, 128 GB/s host-to-device, 800 Gbps NIC; A800 HBM2e 2.04 TB/s.
A800_X8 = Hardware("8xA800", 8, 312e12, 2.039e12, 128e9, 800e9 / 8)
# Not in the papers' cost section; public H800 SXM figures: 989 TFLOPS dense BF16, 3.35 TB/s
# HBM3. Assumed: PCIe Gen5 doubles host-to-device to 256 GB/s; 8 x 400 Gbps RDMA NICs
# (the transfer-engine setup of PAPER.md §7).
H800_X8 = Hardware("8xH800", 8, 989e12, 3.35e12, 256e9, 8 * 400e9 / 8)


# One SSD read's latency: an NVMe 4 KiB random read takes ~0.1 ms.
SSD_LATENCY_S = 1e-4


# --- transfer ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Moving KV of `tokens` tokens between nodes: latency + bytes / bandwidth.

    Nothing to move costs nothing (no round trip is made)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    bytes_per_token: int

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s

    @classmethod
    def for_hardware(
        cls, model: ModelShape, hw: Hardware, *, efficiency: float = 0.5, latency_s: float = 1e-3
    ) -> TransferModel:
        """The NIC at `efficiency` of line rate: the transfer engine reached 87 GB/s on
        4x200 Gbps (87 %) in PAPER.md §7; 0.5 leaves room for contention with other flows."""
        return cls(hw.nic_bytes_per_s * efficiency, latency_s, model.kv_bytes_per_token)


# --- analytic model ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnalyticCostModel:
    """PAPER.md §4: prefill FLOPs for n tokens = l*(a*n²*d + b*n*d²), a = 4, b = 22.

    With a cached prefix of P tokens out of L, the new n = L - P tokens attend to all L:
    the attention term scales with Σ_{i=P}^{L-1} i ∝ L² - P² (equal to n² at P = 0), the
    linear term with n. So FLOPs(L, P) = l*(a*d*(L² - P²) + b*(L - P)*d²).

    Assumptions (stated, not measured): prefill runs at `mfu` of the node's peak (0.5 is
    typical of long-context TP-8 prefill); the prefix's KV streams host -> GPU layer by layer,
    overlapped with compute (PAPER.md §6), so prefill ≈ max(compute, load). An instance may
    reuse less than the whole prefix, so the predictor reports the best reuse: the time is
    non-increasing in P. A decode step streams the weights and the batch's KV from HBM at
    `hbm_efficiency`, plus a fixed per-step overhead (kernel launches, TP all-reduces).
    """

    model: ModelShape
    hw: Hardware
    mfu: float = 0.5
    hbm_efficiency: float = 0.6
    step_overhead_s: float = 0.005
    a: float = 4.0
    b: float = 22.0
    # Derived once (`decode_step_s` runs millions of times in a simulation): the weights'
    # bytes, a token's KV bytes, the usable HBM bandwidth, 2 x params and the usable FLOP/s.
    _weights_bytes: float = field(init=False, repr=False, compare=False)
    _kv_bytes: float = field(init=False, repr=False, compare=False)
    _hbm: float = field(init=False, repr=False, compare=False)
    _two_params: float = field(init=False, repr=False, compare=False)
    _flop_rate: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m, hw = self.model, self.hw
        derived = {
            "_weights_bytes": m.params * m.dtype_bytes,
            "_kv_bytes": m.kv_bytes_per_token,
            "_hbm": hw.gpus * hw.hbm_bytes_per_s_per_gpu * self.hbm_efficiency,
            "_two_params": 2.0 * m.params,
            "_flop_rate": hw.peak_flops * self.mfu,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def _compute_s(self, prompt: float, prefix: float) -> float:
        m = self.model
        flops = m.layers * (
            self.a * m.hidden * (prompt * prompt - prefix * prefix)
            + self.b * (prompt - prefix) * m.hidden * m.hidden
        )
        return flops / (self.hw.peak_flops * self.mfu)

    def _load_s(self, prefix: float) -> float:
        return prefix * self.model.kv_bytes_per_token / self.hw.h2d_bytes_per_s

    def _best_reuse(self, prompt: float, prefix: float) -> float:
        """The reuse in [0, prefix] minimising max(compute, load): where they cross."""
        m, f = self.model, self.hw.peak_flops * self.mfu
        qa = m.layers * self.a * m.hidden / f  # compute = c0 - qa*P² - qb*P
        qb = m.layers * self.b * m.hidden * m.hidden / f
        c0 = self._compute_s(prompt, 0.0)
        k = self.model.kv_bytes_per_token / self.hw.h2d_bytes_per_s
        # qa*P² + (qb + k)*P - c0 = 0, positive root.
        cross = (-(qb + k) + math.sqrt((qb + k) ** 2 + 4 * qa * c0)) / (2 * qa)
        return min(prefix, cross)

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        prompt = float(max(prompt_tokens, 0))
        prefix = self._best_reuse(prompt, float(min(max(cached_tokens, 0), prompt_tokens)))
        return max(self._compute_s(prompt, prefix), self._load_s(prefix))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        memory = (self._weights_bytes + context_tokens * self._kv_bytes) / self._hbm
        compute = self._two_params * max(batch, 0) / self._flop_rate
        return self.step_overhead_s + max(memory, compute)


# --- fitted model --------------------------------------------------------------------------------


def prefill_features(prompt: float, cached: float) -> tuple[float, ...]:
    """A degree-2 polynomial in (L, P) written in a basis where each computing term is
    non-decreasing in L and non-increasing in P (n = L - P): 1, n, n², L² - P²; and P, the
    loading of the cached prefix (its KV copied out of the store's bytes into the engine's
    pages, on a GPU across the host link), which grows with P. With non-negative
    coefficients the fit keeps the physics whatever noise the profile has: computing less
    never takes longer, loading more never takes less. Where loading a token costs more
    than computing it saves (a small model on a GPU, as the issue "Engine speed" measured),
    the fit says so, and `reuse_point` answers how much of a cached prefix is worth loading."""
    n = prompt - cached
    return (1.0, n, n * n, prompt * prompt - cached * cached, cached)


def reuse_point(fit: PolyFit, prompt: float, cached: float) -> float:
    """The tokens of a cached prefix of `cached` (a prompt of `prompt`) whose reuse the
    fitted prefill time is least at, the rest recomputed: exact for the polynomial, which is
    a quadratic in the reused P (the least at an end of [0, cached] or at its vertex). Ties
    go to reusing more. Without a loading cost, all of it (the time falls with P)."""
    c = fit.coef
    _, c1, c2, c3, c4 = c
    if c4 == 0.0:
        return cached
    best, least = cached, _poly(c, prompt, cached)
    curvature = c2 - c3  # t(P) = c2 (L - P)² - c3 P² + (c4 - c1) P + ...
    if curvature > 0:
        vertex = (c1 + 2.0 * c2 * prompt - c4) / (2.0 * curvature)
        if 0.0 < vertex < cached and (t := _poly(c, prompt, vertex)) < least:
            best, least = vertex, t
    return 0.0 if _poly(c, prompt, 0.0) < least else best


def _poly(c: tuple[float, ...], prompt: float, p: float) -> float:
    """The prefill polynomial at (L, P), written out (`prefill_features`; the Conductor
    evaluates it several times a candidate)."""
    n = prompt - p
    return c[0] + c[1] * n + c[2] * n * n + c[3] * (prompt * prompt - p * p) + c[4] * p


def poly_prefill_s(fit: PolyFit, prompt: float, cached: float) -> float:
    """A fitted prefill's seconds with the best reuse of up to `cached` tokens
    (`reuse_point`): non-increasing in `cached`, as every `PrefillModel` is."""
    return _poly(fit.coef, prompt, reuse_point(fit, prompt, cached))


EVEN = 1.0 + 1e-9  # predictions this close are one (float rounding)


def reuse(model: PrefillModel, prompt_tokens: int, cached_tokens: int, block: int
          ) -> tuple[int, float]:  # fmt: skip
    """(tokens, seconds): how many tokens of a cached prefix of `cached_tokens` (whole
    blocks of `block` tokens) a prefill should load rather than compute, by `model`, and
    its predicted seconds so. Every one, unless loading a shorter prefix and computing the
    rest is predicted faster. A `PrefillModel` answers with the best reuse of up to
    `cached_tokens` (its time never grows with them), so this is the fewest whole blocks
    that reach the least time: `cached_tokens` itself where loading pays all the way (one
    more prediction than the time alone), else a bisection."""
    least = model.prefill_s(prompt_tokens, cached_tokens)
    blocks = cached_tokens // block
    if blocks < 1 or model.prefill_s(prompt_tokens, (blocks - 1) * block) > least * EVEN:
        return cached_tokens, least
    lo, hi = 0, blocks - 1  # the answer, in blocks, is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if model.prefill_s(prompt_tokens, mid * block) <= least * EVEN:
            hi = mid
        else:
            lo = mid + 1
    return lo * block, least


def decode_features(batch: float, context: float) -> tuple[float, ...]:
    """Step = fixed + per-sequence + per-context-token (weights, then KV, from HBM)."""
    return (1.0, batch, context)


@dataclass(frozen=True, slots=True)
class PolyFit:
    """y ≈ Σ coef_i * feature_i(x, z), with every coef_i ≥ 0."""

    coef: tuple[float, ...]
    rmse: float
    samples: int

    def __call__(self, features: Sequence[float]) -> float:
        return float(sum(c * f for c, f in zip(self.coef, features, strict=True)))


def fit_nonnegative(rows: Sequence[Sequence[float]], y: Sequence[float]) -> PolyFit:
    """Least squares with non-negative coefficients, exactly: for a handful of features, the
    best unconstrained lstsq fit over every subset of columns that comes out all-non-negative
    (the NNLS optimum is one of them). numpy has no NNLS and scipy is not a dependency."""
    x = np.asarray(rows, dtype=np.float64)
    t = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0 or len(x) != len(t):
        raise ValueError("need a non-empty sample matrix with one target per row")
    # Scale columns so the solver is well conditioned (L² is ~1e8 when L is ~1e4).
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    width = x.shape[1]
    best: tuple[float, np.ndarray] = (math.inf, np.zeros(width))
    for k in range(1, width + 1):
        for cols in itertools.combinations(range(width), k):
            sol, *_ = np.linalg.lstsq(xs[:, cols], t, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(width)
            coef[list(cols)] = sol
            sse = float(np.sum((xs @ coef - t) ** 2))
            if sse < best[0]:
                best = (sse, coef)
    sse, coef = best
    if not math.isfinite(sse):
        coef, sse = np.zeros(width), float(np.sum(t**2))
    return PolyFit(tuple(float(c) for c in coef / scale), math.sqrt(sse / len(t)), len(t))


@dataclass(frozen=True, slots=True)
class FittedCostModel:
    prefill: PolyFit
    decode: PolyFit

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
        return poly_prefill_s(self.prefill, float(max(prompt_tokens, 0)), float(cached))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode(decode_features(float(max(batch, 0)), float(max(context_tokens, 0))))


def _sample(s: Mapping[str, Any], x: str, z: str) -> tuple[float, float, float]:
    return float(s[x]), float(s[z]), float(s["seconds"])


Sample = tuple[float, float, float]  # (x, z, seconds): (prompt, cached) or (batch, context)


def profile_samples(doc: Mapping[str, Any]) -> tuple[list[Sample], list[Sample]]:
    """A profile document's (prefill, decode) samples, checked (see `parse_profile`)."""
    if doc.get("schema", PROFILE_SCHEMA) != PROFILE_SCHEMA:
        raise ValueError(f"unsupported profile schema {doc.get('schema')!r}")
    pre = [_sample(s, "prompt_tokens", "cached_tokens") for s in doc["prefill"]]
    dec = [_sample(s, "batch", "context_tokens") for s in doc["decode"]]
    if any(c > p or c < 0 for p, c, _ in pre):
        raise ValueError("prefill samples need 0 <= cached_tokens <= prompt_tokens")
    return pre, dec


def fit_prefill(samples: Sequence[Sample], load_per_token: float | None = None) -> PolyFit:
    """The prefill polynomial (`prefill_features`) fitted to (prompt, cached, seconds) rows.
    `load_per_token`: the seconds loading a cached token takes, where it is known (a
    profile's fit, `load_s_per_token`): the computing terms are then fitted to what is left
    of the rows' seconds. The online model fits so (core/online_cost.py): its rows mix a
    profile's and the cluster's, and a cluster that runs slower than it was profiled, whose
    prefills mostly reuse a prefix, would otherwise pass for loading that got dearer."""
    if load_per_token is None:
        return fit_nonnegative(
            [prefill_features(p, c) for p, c, _ in samples], [s for *_, s in samples]
        )
    fit = fit_nonnegative(
        [prefill_features(p, c)[:-1] for p, c, _ in samples],
        [s - load_per_token * c for p, c, s in samples],
    )
    return PolyFit((*fit.coef, load_per_token), fit.rmse, fit.samples)


def load_s_per_token(model: PrefillModel) -> float:
    """The seconds a fitted model says loading a cached token takes (0 where it has no such
    term: the analytic model overlaps loading with computing)."""
    return model.prefill.coef[-1] if isinstance(model, FittedCostModel) else 0.0


def fit_decode(samples: Sequence[Sample]) -> PolyFit:
    return fit_nonnegative([decode_features(b, c) for b, c, _ in samples], [s for *_, s in samples])


def parse_profile(doc: Mapping[str, Any]) -> FittedCostModel:
    """Fit a cost model to a profile document (already `json.load`-ed; reading is I/O).

    Schema `mooncake.profile/1` (written by the engine profiler)::

        {"schema": "mooncake.profile/1", "model": "...", "device": "...",
         "prefill": [{"prompt_tokens": int, "cached_tokens": int, "seconds": float}, ...],
         "decode":  [{"batch": int, "context_tokens": int, "seconds": float}, ...]}

    `cached_tokens` ≤ `prompt_tokens` are reused from cache (their load time included in
    `seconds`); `context_tokens` is the KV length summed over the batch for one step.
    """
    pre, dec = profile_samples(doc)
    return FittedCostModel(prefill=fit_prefill(pre), decode=fit_decode(dec))


@dataclass(frozen=True, slots=True)
class Costs:
    """What the Conductor needs to predict: one value passed down, never a global."""

    prefill: PrefillModel
    decode: DecodeModel
    transfer: TransferModel
    # One chunk's activations from a pipeline stage to the next (CPP, core/cpp.py): the
    # hidden state of each token; None: not known, counted as free.
    activation: TransferModel | None = None
    # Reading KV a store node keeps only on SSD (offloaded, store/master_state.py), at the
    # SSD's read speed (`mooncake profile ssd`); None: SSD reads counted as free.
    ssd: TransferModel | None = None

    def hop_s(self, tokens: int) -> float:
        """Seconds `tokens` tokens' activations take from one pipeline stage to the next."""
        return self.activation.transfer_s(tokens) if self.activation is not None else 0.0

    def ssd_s(self, tokens: int) -> float:
        """Seconds reading `tokens` tokens' KV from an SSD takes."""
        return self.ssd.transfer_s(tokens) if self.ssd is not None else 0.0


def reference_costs(hw: Hardware = A800_X8, model: ModelShape = LLAMA3_70B) -> Costs:
    analytic = AnalyticCostModel(model, hw)
    kv = TransferModel.for_hardware(model, hw)
    # A token's hidden state (hidden x dtype bytes: 16 KiB for LLaMA3-70B, 1/20 of its KV)
    # over the same NIC at the same efficiency and latency as KV.
    act = TransferModel(kv.bandwidth_bytes_per_s, kv.latency_s, model.hidden * model.dtype_bytes)
    ssd = TransferModel(hw.ssd_bytes_per_s, SSD_LATENCY_S, model.kv_bytes_per_token)
    return Costs(analytic, analytic, kv, act, ssd)
