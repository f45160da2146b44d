"""Counterfactual replay ("what if"): recorded arrivals through the simulator under another
policy, compared with what the live system recorded (DESIGN.md, Postgres: the record).

Pure: `RecordedRequest`s in (read from Postgres by `mooncake.commands.replay`), a comparison
out. A recorded arrival becomes a trace request:
- arrival: its `request.submitted` time, relative to the first arrival;
- prompt length: the token ids' count; for a text prompt the count the prefill recorded,
  else an estimate of 4 bytes a token (counted in `estimated_prompts`);
- output length: the tokens it produced if it completed, else the `max_tokens` it asked for;
- prefix structure: chained block keys (`mooncake.hashing`) of the token ids, or of the
  prompt's UTF-8 bytes in blocks of 4 x block_tokens bytes, so equal prefixes share keys.
Times come from the simulator's cost model (the analytic reference hardware unless told
otherwise), so the counterfactual's TTFT/TBT are on that hardware, not the recorded one's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake.core.quantile import percentiles
from mooncake.hashing import block_keys
from mooncake.sim.request import tbt_score
from mooncake.sim.runner import SimResult
from mooncake.trace import TraceRequest

BYTES_PER_TOKEN = 4  # estimate for text prompts whose token count was never recorded


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    request_id: str
    arrival_s: float  # seconds since the epoch (or any fixed origin)
    token_ids: tuple[int, ...] | None
    prompt: str | None
    max_tokens: int
    status: str | None  # the `requests` projection's status, if it has the request
    policy: str | None
    prompt_tokens: int | None  # as the prefill recorded it
    output_tokens: int
    reject_reason: str | None
    ttft_s: float | None
    tbt_s: float | None


@dataclass(frozen=True, slots=True)
class ReplayInput:
    trace: list[TraceRequest]
    estimated_prompts: int


def _prompt_of(
    r: RecordedRequest, block_tokens: int, seed: int, salt: str
) -> tuple[int, list[str], bool]:
    """(prompt tokens, block keys, estimated?)"""
    if r.token_ids is not None:
        return len(r.token_ids), block_keys(r.token_ids, block_tokens, seed=seed, salt=salt), False
    raw = (r.prompt or "").encode()
    keys = block_keys(list(raw), block_tokens * BYTES_PER_TOKEN, seed=seed, salt=salt)
    if r.prompt_tokens:
        return r.prompt_tokens, keys, False
    return max(1, math.ceil(len(raw) / BYTES_PER_TOKEN)), keys, True


def to_trace(
    records: Sequence[RecordedRequest], block_tokens: int, *, seed: int = 0, salt: str = "replay"
) -> ReplayInput:
    """Recorded arrivals (in arrival order) as trace requests; block keys become small
    integer ids, as in the shared traces."""
    ids: dict[str, int] = {}
    out: list[TraceRequest] = []
    estimated = 0
    t0 = records[0].arrival_s if records else 0.0
    for i, r in enumerate(records):
        tokens, keys, guess = _prompt_of(r, block_tokens, seed, salt)
        estimated += guess
        whole = tokens // block_tokens
        hash_ids = tuple(ids.setdefault(k, len(ids)) for k in keys[:whole])
        output = r.output_tokens if r.status == "completed" and r.output_tokens else r.max_tokens
        out.append(TraceRequest(i, max(r.arrival_s - t0, 0.0), tokens, output, hash_ids))
    return ReplayInput(out, estimated)


def _recorded_outcome(r: RecordedRequest) -> str:
    if r.reject_reason is not None or r.status == "rejected":
        return "rejected"
    return r.status or "unrecorded"


def compare(records: Sequence[RecordedRequest], sim: SimResult) -> dict[str, Any]:
    """Recorded vs counterfactual outcomes, request by request and in aggregate."""
    rec_reasons = Counter(
        r.reject_reason or "unknown" for r in records if _recorded_outcome(r) == "rejected"
    )
    sim_reasons = Counter(
        (s.rejected or "").split(":", 1)[-1] for s in sim.requests if s.rejected is not None
    )
    rec_statuses = Counter(_recorded_outcome(r) for r in records)
    flips = Counter(
        (_recorded_outcome(r) == "rejected", s.rejected is not None)
        for r, s in zip(records, sim.requests, strict=True)
    )
    done = [s for s in sim.requests if s.done and s.rejected is None]
    return {
        "requests": len(records),
        "recorded": {
            "policies": dict(Counter(r.policy or "unknown" for r in records)),
            "admitted": len(records) - rec_statuses["rejected"],
            "rejected": rec_statuses["rejected"],
            "rejected_by_reason": dict(sorted(rec_reasons.items())),
            "completed": rec_statuses["completed"],
            "statuses": dict(sorted(rec_statuses.items())),
            "ttft_s": percentiles([r.ttft_s for r in records if r.ttft_s is not None]),
            "tbt_s": percentiles([r.tbt_s for r in records if r.tbt_s is not None]),
        },
        "counterfactual": {
            "policy": sim.config.policy,
            "admitted": len(records) - sum(sim_reasons.values()),
            "rejected": sum(sim_reasons.values()),
            "rejected_by_reason": dict(sorted(sim_reasons.items())),
            "completed": len(done),
            "ttft_s": percentiles([s.ttft for s in done if s.ttft is not None]),
            "tbt_s": percentiles([tbt_score(s.gaps) for s in done]),
        },
        "changed": {
            "admitted_now_rejected": flips[(False, True)],
            "rejected_now_admitted": flips[(True, False)],
        },
    }


def _fmt(v: object) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def comparison_rows(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, recorded, counterfactual) rows for a table."""
    rec, cf = c["recorded"], c["counterfactual"]
    rows = [
        ("policy", ", ".join(f"{k} ({n})" for k, n in rec["policies"].items()), cf["policy"]),
        ("requests", str(c["requests"]), str(c["requests"])),
        ("admitted", str(rec["admitted"]), str(cf["admitted"])),
        ("rejected", str(rec["rejected"]), str(cf["rejected"])),
    ]
    for reason in sorted({*rec["rejected_by_reason"], *cf["rejected_by_reason"]}):
        rows.append((
            f"  rejected: {reason}",
            str(rec["rejected_by_reason"].get(reason, 0)),
            str(cf["rejected_by_reason"].get(reason, 0)),
        ))  # fmt: skip
    rows.append(("completed", str(rec["completed"]), str(cf["completed"])))
    for metric in ("ttft_s", "tbt_s"):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{metric.removesuffix('_s').upper()} {q} (s)",
                         _fmt(rec[metric][q]), _fmt(cf[metric][q])))  # fmt: skip
    ch = c["changed"]
    rows.append(("admitted -> rejected", "", str(ch["admitted_now_rejected"])))
    rows.append(("rejected -> admitted", "", str(ch["rejected_now_admitted"])))
    return rows
