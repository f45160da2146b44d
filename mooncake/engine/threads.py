"""How many threads a decode step runs on: one, or all the engine has, whichever its own
steps measure faster, per batch size (issue 42).

Why measured. A fused decode step (engine.fused) meets ~150 OpenMP barriers, so on 2
threads it is as fast as the slower thread: alone on a 2-vCPU Xeon with AMX, SmolLM2's step
of one sequence took 10.7 ms on 2 threads and 18.5 ms on 1, but inside `mooncake up`, with
the broker, the gateway and the client each waking for every token the step streams, the
2-thread step took 22 ms (py-spy: ~3/4 of it in libgomp's barrier waits) while a 1-thread
step is not slowed by a process on the other CPU. Which wins depends on the batch (more rows
give each barrier more work) and on what else the host runs, so it is measured as it runs:
per batch-size bucket (1, 2-3, 4-7, ...), an exponential average of each way's step time,
each way tried MIN_SAMPLES times first, then the faster taken, the other tried again every
EXPLORE_EVERY steps of the bucket so that a change (a prefill instance starting to share
the CPUs) is followed.

Only where the step's result does not depend on its thread count: the fused kernels over
quantized weights give each output row to one thread, so 1 and 2 threads give bit-equal
logits (`StepThreads.applies`). Elsewhere (eager steps over oneDNN/MKL GEMMs, CUDA) the
engine keeps its thread count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

MIN_SAMPLES = 3  # steps of each way before the faster is taken
EXPLORE_EVERY = 16  # then one step of the other way in this many
ALPHA = 0.25  # weight of a new step time in a way's average


def bucket(batch: int) -> int:
    """The batch-size bucket a step of `batch` sequences is timed in: 1, 2-3, 4-7, ..."""
    return max(batch, 1).bit_length()


class StepThreads:
    """The thread count of each decode step (see the module's doc). `full`: the engine's
    count (torch's, where not given: read at each step, so a later `set_num_threads` holds);
    `applies`: whether the steps' results do not depend on it (else `full` always)."""

    def __init__(self, full: int | None = None, applies: bool = True) -> None:
        self._full, self._on = full, applies
        self._avg: dict[tuple[int, int], float] = {}
        self._samples: dict[tuple[int, int], int] = {}
        self._steps: dict[int, int] = {}

    @property
    def full(self) -> int:
        return max(self._full if self._full is not None else torch.get_num_threads(), 1)

    @property
    def ways(self) -> tuple[int, ...]:
        full = self.full
        return (1, full) if self._on and full > 1 else (full,)

    @property
    def applies(self) -> bool:
        return len(self.ways) > 1

    def pick(self, batch: int) -> int:
        """The thread count for the next step of `batch` sequences."""
        ways = self.ways
        if len(ways) == 1:
            return ways[0]
        b = bucket(batch)
        for way in ways:  # each way measured before any is trusted
            if self._samples.get((b, way), 0) < MIN_SAMPLES:
                return way
        best = min(ways, key=lambda w: self._avg[(b, w)])
        n = self._steps.get(b, 0)
        if n % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return next(w for w in ways if w != best)
        return best

    def observe(self, batch: int, threads: int, seconds: float) -> None:
        """A step of `batch` sequences on `threads` threads took `seconds`."""
        if threads not in self.ways or len(self.ways) == 1 or not seconds > 0:
            return
        b = bucket(batch)
        key = (b, threads)
        old = self._avg.get(key)
        self._avg[key] = seconds if old is None else old + ALPHA * (seconds - old)
        self._samples[key] = self._samples.get(key, 0) + 1
        self._steps[b] = self._steps.get(b, 0) + 1

    def faster(self, batch: int) -> int | None:
        """The way measured faster for `batch` so far (None before both were measured)."""
        b, ways = bucket(batch), self.ways
        if len(ways) == 1 or any((b, w) not in self._avg for w in ways):
            return None
        return min(ways, key=lambda w: self._avg[(b, w)])

    @contextlib.contextmanager
    def step(self, batch: int) -> Iterator[None]:
        """Run what is inside (one decode step) on the picked thread count, timed; the
        engine's own count is back afterwards (a prefill, a recompute run on all)."""
        full = self.full
        if not self.applies:
            yield
            return
        threads = self.pick(batch)
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            torch.set_num_threads(full)
        self.observe(batch, threads, seconds)
