"""Per-client rate limits: a token bucket per client, pure (time is an argument).

A bucket holds up to `burst` tokens and refills at `rate_per_s`; a request takes one. A
client that sends faster than the rate gets its burst, then one request per 1/rate seconds;
what it sends beyond that is refused with the time after which one more would fit (the
`Retry-After` a gateway answers with). Other clients have buckets of their own, so one
client's flood cannot use up their share.

`ClientLimits` keeps at most `max_clients` buckets, dropping the least recently used: a
bucket idle for `burst / rate_per_s` seconds is full again, i.e. the same as a new one, so
dropping idle buckets forgets nothing; under a swarm of distinct ids (more than
`max_clients` active at once) the oldest lose their history, which can only be in their
favour, while memory stays bounded.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limit:
    """`rate_per_s` <= 0 turns limiting off."""

    rate_per_s: float
    burst: float

    def __post_init__(self) -> None:
        if self.rate_per_s > 0 and self.burst < 1:
            raise ValueError("a limit's burst must let at least one request through")

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0


@dataclass(slots=True)
class TokenBucket:
    limit: Limit
    tokens: float
    updated_at: float

    @classmethod
    def full(cls, limit: Limit, now: float) -> TokenBucket:
        return cls(limit, limit.burst, now)

    def _refill(self, now: float) -> None:
        # A clock that steps back (another monotonic source) never takes tokens away.
        elapsed = max(now - self.updated_at, 0.0)
        self.tokens = min(self.limit.burst, self.tokens + elapsed * self.limit.rate_per_s)
        self.updated_at = max(now, self.updated_at)

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take `cost` tokens: 0.0 when they were there, else the seconds until they will be
        (nothing is taken then: a refused request costs the client nothing)."""
        if not self.limit.enabled:
            return 0.0
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.limit.rate_per_s


class ClientLimits:
    """One bucket per client id, at most `max_clients` of them (least recently used go)."""

    def __init__(self, limit: Limit, max_clients: int = 10_000) -> None:
        if max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        self.limit = limit
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str, now: float) -> float:
        """0.0 if `client` may send one more request now, else seconds until it may."""
        if not self.limit.enabled:
            return 0.0
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket.full(self.limit, now)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
        return bucket.take(now)


def retry_after_s(wait_s: float) -> int:
    """A wait as HTTP's `Retry-After` (whole seconds, at least 1)."""
    return max(1, math.ceil(wait_s))
