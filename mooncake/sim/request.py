"""One simulated request's life and the per-request scores (PAPER.md §7).

TTFT = arrival -> first token (the prefill's last token). TBT is scored as FAST'25 does:
the mean of the slowest 10 % of the request's inter-token gaps (at least one gap). A request
preempted at decode keeps its tokens; the gap to its next token spans the whole wait and the
reload (`decode.emit_tokens` measures each gap from the previous token), so its TBT score
shows the preemption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mooncake.trace import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(slots=True)
class SimRequest:
    rid: str
    arrival: float
    prompt: int
    output: int  # tokens to generate, >= 1 (the first comes from the prefill)
    keys: tuple[str, ...]  # chained keys of the prompt's whole blocks
    first_token_at: float | None = None
    last_token_at: float = 0.0
    generated: int = 0
    gaps: list[float] = field(default_factory=list)
    finished_at: float | None = None
    rejected: str | None = None  # "<stage>:<reason>"
    reused_tokens: int = 0  # prefix tokens the prefill did not recompute
    prefill_compute_s: float = 0.0
    wasted_prefill: bool = False
    preemptions: int = 0  # times a decode instance preempted it for KV pages
    prefill_stages: int = 1  # prefill instances that ran it (CPP group), 1: one

    def first_token(self, now: float) -> None:
        self.first_token_at = self.last_token_at = now
        self.generated = 1

    @property
    def context(self) -> int:
        return self.prompt + self.generated

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def done(self) -> bool:
        return self.finished_at is not None


def tbt_score(gaps: list[float]) -> float:
    """Mean of the slowest 10 % of gaps (ceil, so >= 1 gap); 0 with no gaps."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) * 0.1))
    worst = sorted(gaps, reverse=True)[:k]
    return sum(worst) / k


def from_trace(t: TraceRequest, block_tokens: int = TRACE_BLOCK_TOKENS) -> SimRequest:
    whole = t.input_length // block_tokens
    return SimRequest(
        rid=f"r{t.index}",
        arrival=t.arrival_s,
        prompt=t.input_length,
        output=max(t.output_length, 1),
        keys=tuple(str(h) for h in t.hash_ids[:whole]),
    )
