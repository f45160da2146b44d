"""The one quantile every figure of the project uses: nearest rank (pure).

The q-quantile of n values is the smallest value with at least q * n values at or below
it: sorted(values)[ceil(q * n) - 1]. No interpolation, so a reported p90 is a value that
was observed. `inf` counts as a value (a miss that never finished).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank `q`-quantile (0 < q <= 1) of `values`; None for no values."""
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def percentiles(
    values: Iterable[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99), digits: int | None = None
) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} (the keys from `qs`), each rounded to `digits`
    when given; None for each with no values."""
    v = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        x = quantile(v, q)
        out[f"p{round(q * 100)}"] = round(x, digits) if x is not None and digits is not None else x
    return out
