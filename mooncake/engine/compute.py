"""The one thread a process runs its engine work on (`run`): building the engine, its
calibration, prefills, decode steps, pipeline chunks.

Why one. torch's CPU kernels run in OpenMP teams, and each thread that calls into them gets
a team of its own. A worker that sent its engine calls to asyncio's pool of threads ended up
with several, and every prefill then ran slower, whichever thread it ran on, the first one
included: on a 2-vCPU Xeon (SmolLM2, 2 threads, bfloat16 GEMMs) a 512-token prefill took
0.22 s on one thread and 0.32-0.40 s once a second thread had computed, a 3,000-token one
1.6-1.7 s against 2.3-2.9 s (issue 42). Calls made here run one at a time, in order; work
that waits on another engine call (a prefix loader feeding a prefill's layers) stays off
this thread.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_ENGINE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


async def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on the engine thread, awaited."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_ENGINE, functools.partial(fn, *args, **kwargs))


def call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """The same from synchronous code (a worker's start): blocks until it returns."""
    return _ENGINE.submit(fn, *args, **kwargs).result()
