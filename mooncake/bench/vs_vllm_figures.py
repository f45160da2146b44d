"""`mooncake bench vs-vllm`'s pure parts: the workload both servers get, what one request
and one run at a rate measured, the search for the rate where the peer's goodput peaks,
and the top-level ratios (issue 42). No I/O and no clocks: times are arguments.

The workload is the Mooncake trace's: each hash id is a fixed run of `block_tokens` token
ids (`trace.request_tokens`; requests that share ids share a prefix), a prompt is cut to
`max_prompt` tokens, `max_tokens` is the trace's output length capped at `max_output`,
greedy. A run at speed s sends request i at its trace timestamp / s. Runs at different
rates draw their tokens with different seeds, so no run finds the blocks of an earlier one
in a server's cache, while each keeps the trace's own sharing.

A request is good when it completed, its time to first token (TTFT) is within the TTFT SLO
and the 90th percentile of its gaps between tokens (TBT) within the TBT SLO. Goodput is the
good requests over the run's span: from its first send to its last answer's end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake.core.quantile import percentiles, quantile
from mooncake.trace import TraceRequest, request_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    """What defines the prompts (the same for both servers)."""

    block_tokens: int = 512
    max_prompt: int = 3000
    max_output: int = 64
    vocab_size: int = 49152


@dataclass(frozen=True, slots=True)
class Ask:
    """One request of a run: when it is sent (seconds after the run starts) and what."""

    index: int
    at_s: float
    tokens: list[int]
    max_tokens: int


def asks(trace: Sequence[TraceRequest], work: Workload, speed: float, seed: int) -> list[Ask]:
    """The run of `trace` at `speed` (1: the trace's own timing; 0.1: ten times slower)."""
    if speed <= 0:
        raise ValueError(f"a speed is above 0, not {speed}")
    if not trace:
        raise ValueError("the trace holds no requests")
    t0 = trace[0].arrival_s
    out = []
    for r in trace:
        tokens = request_tokens(
            r, vocab_size=work.vocab_size, tokens_per_block=work.block_tokens, seed=seed
        )[: work.max_prompt]
        out.append(
            Ask(
                r.index,
                (r.arrival_s - t0) / speed,
                tokens,
                max(1, min(r.output_length, work.max_output)),
            )
        )
    return out


def rate_of(trace: Sequence[TraceRequest], speed: float) -> float:
    """Requests per second a run at `speed` sends (over its arrivals' span)."""
    span = (trace[-1].arrival_s - trace[0].arrival_s) / speed
    return len(trace) / span if span > 0 else float("inf")


@dataclass(slots=True)
class Answer:
    """What the client saw of one request. Times are seconds on the client's clock; a
    request that got no token has `first_s` None."""

    sent_s: float
    prompt_tokens: int
    first_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # every chunk with a token, in order
    end_s: float | None = None
    completed: bool = False
    tokens: int = 0  # the server's count where it gave one (usage), else the chunks
    rejected: str | None = None  # the reason code of a refusal (429)
    error: str | None = None  # anything else that kept it from completing

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def tbt_p90(self) -> float | None:
        return quantile(self.gaps, 0.9)


def good(a: Answer, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """Completed within both SLOs (a one-token answer has no gap to miss)."""
    ttft = a.ttft_s
    tbt = a.tbt_p90()
    return a.completed and ttft is not None and ttft <= ttft_slo_s and (tbt or 0.0) <= tbt_slo_s


@dataclass(frozen=True, slots=True)
class CpuUse:
    """CPU seconds a server's processes used during a run, by role, over `window_s` on
    `cpus` CPUs."""

    by_role: dict[str, float]
    window_s: float
    cpus: int

    def busy(self) -> float:
        """The share of the CPUs' time they used (1: every CPU busy all the time)."""
        room = self.window_s * self.cpus
        return round(sum(self.by_role.values()) / room, 3) if room > 0 else 0.0


def run_figures(
    answers: Sequence[Answer],
    ttft_slo_s: float,
    tbt_slo_s: float,
    peak_pss: int | None,
    cpu: CpuUse | None = None,
) -> dict[str, Any]:
    """One server's figures at one rate (`cpu`: what its processes used meanwhile)."""
    done = [a for a in answers if a.completed]
    ends = [a.end_s for a in answers if a.end_s is not None]
    start = min((a.sent_s for a in answers), default=0.0)
    span = max(ends, default=start) - start
    n_good = sum(good(a, ttft_slo_s, tbt_slo_s) for a in answers)
    gaps = [g for a in done for g in a.gaps]
    ttfts = [t for a in done if (t := a.ttft_s) is not None]
    reasons = Counter(a.rejected for a in answers if a.rejected is not None)
    errors = Counter(a.error for a in answers if a.error is not None and a.rejected is None)
    return {
        "requests": len(answers),
        "completed": len(done),
        "good": n_good,
        "goodput_rps": round(n_good / span, 4) if span > 0 else 0.0,
        "rejected": sum(reasons.values()),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "errors": dict(sorted(errors.items())),
        "ttft_s": percentiles(ttfts, digits=3),
        "tbt_s": percentiles(gaps, digits=4),
        "prompt_tok_s": round(sum(a.prompt_tokens for a in done) / span, 1) if span > 0 else 0.0,
        "output_tokens": sum(a.tokens for a in done),
        "span_s": round(span, 2),
        "peak_pss_mb": None if peak_pss is None else round(peak_pss / (1 << 20), 1),
        "cpu_s": None if cpu is None else {k: round(v, 1) for k, v in cpu.by_role.items()},
        "cpu_busy": None if cpu is None else cpu.busy(),
    }


def lone_figures(a: Answer) -> dict[str, Any]:
    """TTFT and decode speed of a request alone on the server."""
    decode_s = None if a.end_s is None or a.first_s is None else a.chunk_s[-1] - a.first_s
    steps = len(a.chunk_s) - 1
    return {
        "completed": a.completed,
        "error": a.rejected or a.error,
        "ttft_s": None if a.ttft_s is None else round(a.ttft_s, 4),
        "decode_tok_s": round(steps / decode_s, 2) if decode_s and steps > 0 else None,
        "tokens": a.tokens,
    }


@dataclass
class PeakSearch:
    """The speed where a server's goodput peaks, found by doubling or halving from a first
    guess: up while goodput rises, down when the first step up did not; at most `probes`
    runs. Pure: `next_speed` names the run to make, `record` takes its goodput."""

    start: float = 0.1
    probes: int = 4
    seen: dict[float, float] = field(default_factory=dict)  # speed -> goodput

    def record(self, speed: float, goodput: float) -> None:
        self.seen[speed] = goodput

    def next_speed(self) -> float | None:
        """The next speed to run, or None when the peak is found (or probes are spent)."""
        if not self.seen:
            return self.start
        if len(self.seen) >= self.probes:
            return None
        best = self.peak()
        up, down = best * 2, best / 2
        if up not in self.seen:
            return up
        # The step up from the best did not beat it: look below, unless that is known.
        if down not in self.seen and self.seen[best] > 0:
            return down
        return None

    def peak(self) -> float:
        """The best speed so far (the slower one of a tie: the same goodput for less load)."""
        return max(self.seen, key=lambda s: (self.seen[s], -s))


def ratio(ours: float | None, theirs: float | None, digits: int = 3) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return round(ours / theirs, digits)


def summary(
    rates: Sequence[dict[str, Any]],
    lone: dict[str, dict[str, Any]],
    pss: dict[str, int | None],
) -> dict[str, Any]:
    """The issue's top-level fields from the per-rate figures (each {"speed", "vllm",
    "mooncake"}), the lone request's and each server's peak PSS over the whole run."""
    positive = [r for r in rates if r["vllm"]["goodput_rps"] > 0]
    ratios = [ratio(r["mooncake"]["goodput_rps"], r["vllm"]["goodput_rps"]) for r in positive]
    overload = [r for r in rates if r["vllm"]["goodput_rps"] == 0]
    lowest = rates[0]["mooncake"] if rates else None
    tbt90 = [r["mooncake"]["tbt_s"]["p90"] for r in rates if r["mooncake"]["tbt_s"]["p90"]]
    return {
        "goodput_ratio_min": min((r for r in ratios if r is not None), default=None),
        "overload_goodput_positive": all(r["mooncake"]["goodput_rps"] > 0 for r in overload),
        "lowest_rate_rejected_frac": (
            round(lowest["rejected"] / lowest["requests"], 4)
            if lowest and lowest["requests"]
            else None
        ),
        "lone_ttft_ratio": ratio(lone["mooncake"].get("ttft_s"), lone["vllm"].get("ttft_s")),
        "lone_decode_ratio": ratio(
            lone["mooncake"].get("decode_tok_s"), lone["vllm"].get("decode_tok_s")
        ),
        "pss_ratio": ratio(pss.get("mooncake"), pss.get("vllm")),
        "tbt_p90_s_max": max(tbt90, default=None),
    }
