"""Timing engine work: `seconds` (one call, a CUDA device's queued work included), what
`bench engine`, the contiguous-batch bench and `profile engine` time with; `paired`, the
paired timing `bench engine` reports its ratios with; and `speedup`, which of two ways of
computing one thing runs faster on this machine, measured in this process (best of each),
what the engine takes a faster path by only where it is one.

A CPU's flags say what it can run, not how fast: on a 2-vCPU Xeon (family 6, model 207)
whose VM exposes AVX512_BF16 but no AMX, oneDNN's bfloat16 GEMMs of SmolLM2's shapes ran at
0.11-0.15 TFLOP/s against float32's 0.20-0.26, and the native bfloat16 prefill attention
made a 2,048-token prefill ~9 % slower; with AMX the same GEMMs ran 4-8x faster than
float32, and on a Zen 4 EPYC the bfloat16 attention ~1.6x faster (BENCHMARKS.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# A faster path must take at most 1 / FASTER of the other's time, so that a noisy machine
# does not pick a path that merely tied.
FASTER = 1.1


def _interleaved(
    ours: Callable[[], float], theirs: Callable[[], float], reps: int
) -> tuple[list[float], list[float]]:
    """`reps` timings of each, back to back in each repetition, after one warm-up each."""
    ours(), theirs()
    a, b = [], []
    for _ in range(reps):
        a.append(ours())
        b.append(theirs())
    return a, b


def paired(
    ours: Callable[[], float], theirs: Callable[[], float], reps: int
) -> tuple[float, float, float]:
    """(median ours, median theirs, median of the per-repetition ratios theirs/ours), each
    callable returning the seconds it took. The two run back to back in each repetition,
    after one warm-up each, so a burst of load from elsewhere on the machine hits both sides
    of a pair."""
    a, b = _interleaved(ours, theirs, reps)
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    return statistics.median(a), statistics.median(b), ratio


def seconds(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """The seconds one call of `fn` took; on a CUDA `device`, its queued work included
    (synchronized before and after)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def best_ratio(ours: Callable[[], float], theirs: Callable[[], float], reps: int) -> float:
    """theirs' fastest over ours' fastest of `reps` interleaved calls each (after one
    warm-up each), each callable returning the seconds it took. Load from elsewhere on the
    machine only ever adds time, so the fastest call of each way is the least disturbed one;
    a median of pairs is not: while `up`'s other processes started (importing torch on the
    same two CPUs, one mapping its KV pool), the median of 5 pairs measured bfloat16 GEMMs
    that run 4x faster at under 1.1x, and the engine took float32."""
    a, b = _interleaved(ours, theirs, reps)
    return min(b) / min(a)


def speedup(candidate: Callable[[], object], baseline: Callable[[], object], reps: int = 9
            ) -> float:  # fmt: skip
    """How many times faster `candidate` runs than `baseline` here (best_ratio)."""
    return best_ratio(lambda: seconds(candidate), lambda: seconds(baseline), reps)
