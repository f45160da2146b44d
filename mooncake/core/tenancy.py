"""Per-tenant admission shares (issue 20): one tenant flooding must not take the others'
goodput.

Under contention, a tenant may hold at most its weighted fair share of the prefill work the
cluster has in flight (queued or running, predicted seconds): share_t = w_t / sum of w over
the tenants with work in flight. A tenant already past its share is rejected with
`tenant_quota` (its next request waits for its own work to drain); the others keep being
admitted by the SLO policy as before. Its first request over the share is admitted: shares
judge the work a tenant holds, not the size of the request in hand, so one long prompt is
not refused for being long.

Shares bind only while the cluster is contended, when the request's predicted prefill load
(TTFT over the TTFT SLO, `Decision.prefill_load`) is at least `contention`: an idle cluster
serves anyone, however much it sends. A single tenant (the default deployment) is never
over its share. Pure: numbers in, a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantShares:
    weights: tuple[tuple[str, float], ...] = ()  # tenant -> weight; unnamed: default_weight
    default_weight: float = 1.0
    # Shares bind once the predicted prefill load (TTFT / SLO) reaches this.
    contention: float = 0.5

    def weight(self, tenant: str) -> float:
        for name, w in self.weights:
            if name == tenant:
                return w
        return self.default_weight


@dataclass(frozen=True, slots=True)
class ShareVerdict:
    over: bool
    held_s: float  # the tenant's prefill work in flight, seconds
    share: float  # its part of all the work in flight
    fair: float  # its weighted fair share among the tenants with work in flight


def share_verdict(work: Mapping[str, float], tenant: str, shares: TenantShares) -> ShareVerdict:
    """Whether `tenant` holds more than its fair share of `work` (predicted prefill seconds
    in flight per tenant). Only tenants with work count, so a tenant alone is never over."""
    active = [t for t, s in work.items() if s > 0]
    held = max(work.get(tenant, 0.0), 0.0)
    total = sum(max(s, 0.0) for s in work.values())
    if held <= 0 or total <= 0 or len(active) < 2:
        return ShareVerdict(False, held, 1.0 if held > 0 else 0.0, 1.0)
    fair = shares.weight(tenant) / sum(shares.weight(t) for t in active)
    share = held / total
    # Past it, not at it: equal tenants are all within their shares (float rounding aside).
    return ShareVerdict(share > fair * (1 + 1e-9), held, share, fair)
