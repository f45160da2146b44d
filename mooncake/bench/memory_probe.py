"""What `mooncake bench memory` needs of the engine itself, measured in a child process before
the stack starts: the weights' bytes (for each engine role's bound), and the decode speed of
the paged KV pool at batch 32 against the old contiguous layout (`bench.contiguous`), on a
quiet machine. In a child, so that the engine (weights, KV pages, torch's threads) is gone
from this process when the workers start and are measured.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ByteSize

from mooncake.config import Settings


@dataclass(frozen=True)
class RatioOptions:
    """The paged-vs-contiguous decode run: `prompts` sequences of `prompt_tokens` random
    tokens, `steps` timed steps, `reps` paired repetitions, `threads` torch threads."""

    prompts: int = 32
    prompt_tokens: int = 512
    steps: int = 32
    reps: int = 3
    threads: int = 2


def probe_engine(settings: Settings, ratio: RatioOptions | None) -> dict[str, Any]:
    """(In the child.) Build the workers' engine; its weights, and the decode ratio."""
    import torch

    from mooncake.bench.contiguous import decode_ratio, pool_bytes_needed
    from mooncake.model_info import model_spec
    from mooncake.serving.models import build_engine, weights_bytes

    engine_settings = settings.engine
    kv = settings.kv_cache_bytes
    if ratio is not None:
        engine_settings = engine_settings.model_copy(update={"threads": ratio.threads})
        spec = model_spec(settings.engine)
        kv = ByteSize(pool_bytes_needed(spec, ratio.prompts, ratio.prompt_tokens, ratio.steps))
    update = {"engine": engine_settings, "kv_cache_bytes": kv}
    engine = build_engine(settings.model_copy(update=update))
    out: dict[str, Any] = {
        "weights_bytes": weights_bytes(engine),
        "context_tokens": engine.spec.context,
    }
    if ratio is not None:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.spec.vocab_size
        prompts = [
            torch.randint(0, vocab, (ratio.prompt_tokens,), generator=gen).tolist()
            for _ in range(ratio.prompts)
        ]
        out["decode"] = {
            **decode_ratio(engine, prompts, ratio.steps, ratio.reps),
            **asdict(ratio),
        }
    return out


def run_probe(settings: Settings, ratio: RatioOptions | None) -> dict[str, Any]:
    """`probe_engine` in a fresh (spawned) process; its result."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(probe_engine, settings, ratio).result()
