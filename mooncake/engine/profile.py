"""`mooncake profile engine`: measure the real engine for the Conductor's cost model.

Two grids, each point the median of `reps` timings after one warm-up:

- prefill over (prompt length L, cached prefix P): P whole blocks of the prompt are handed to
  `Engine.prefill` as cached KV (built from block tensors, as a store hit would be; that
  build is inside the clock, since the schema counts the load time in `seconds`) and the
  remaining L - P tokens are computed. Only P < L that are whole blocks are measured.
- decode over (batch B, context C): B sequences of C tokens of KV each run one
  continuous-batching step (`DecodeBatch.step`, sampling included). The sequences share one
  prefill (their KV is copied), so the grid costs one prefill per context, not B.

The document is `mooncake.profile/1` (`mooncake.core.cost_model.parse_profile`):
`context_tokens` is the KV length summed over the batch.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mooncake.engine import speed
from mooncake.engine.batch import DecodeBatch
from mooncake.engine.engine import Engine, Prefilled, min_pool_tokens
from mooncake.engine.errors import EngineError
from mooncake.engine.pool import PagedKV
from mooncake.engine.sampling import SamplingParams
from mooncake.trace import block_tokens

PROFILE_SCHEMA = "mooncake.profile/1"  # the schema mooncake.core.cost_model parses

DEFAULT_PROMPTS = (256, 512, 1024, 2048)
DEFAULT_CACHED = (0, 256, 512, 1024, 1536)
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (128, 512, 1024, 2048)

Log = Callable[[str], None]
log = logging.getLogger("mooncake.engine")


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in block_tokens(seed, n, vocab, seed=4321)]


def _median(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(reps))


def _copy_kv(engine: Engine, kv: PagedKV) -> PagedKV:
    """A private copy of a sequence's KV in other pages of the pool."""
    with torch.inference_mode():
        return engine.prefix_from_blocks([kv.piece(0, kv.length)])


def profile_prefill(
    engine: Engine, prompts: Sequence[int], cached: Sequence[int], reps: int, log: Log
) -> list[dict[str, Any]]:
    dev, bt, vocab = engine.device, engine.block_tokens, engine.spec.vocab_size
    rows: list[dict[str, Any]] = []
    for length in prompts:
        engine.check_tokens([0] * length)
        tokens = _tokens(length, vocab, length)
        points = sorted({p for p in cached if p % bt == 0 and 0 <= p < length})
        blocks = engine.blocks(engine.prefill(tokens).kv) if any(points) else []
        for prefix in points:
            use = blocks[: prefix // bt]

            def once(use: list[torch.Tensor] = use, tokens: list[int] = tokens) -> float:
                def run() -> None:  # building the KV from the blocks is inside the clock
                    engine.prefill(tokens, prefix=engine.prefix_from_blocks(use) if use else None)

                return speed.seconds(run, dev)

            seconds = _median(once, reps)
            log(f"prefill {length} tokens, {prefix} cached: {seconds * 1e3:.1f} ms")
            rows.append({"prompt_tokens": length, "cached_tokens": prefix, "seconds": seconds})
    return rows


def profile_decode(
    engine: Engine, batches: Sequence[int], contexts: Sequence[int], reps: int, log: Log
) -> list[dict[str, Any]]:
    dev, vocab = engine.device, engine.spec.vocab_size
    rows: list[dict[str, Any]] = []
    steps = reps + 1  # one warm-up step, then `reps` timed ones
    for context in contexts:
        engine.check_tokens([0] * context, extra=steps + 1)
        base = engine.prefill(_tokens(context, vocab, 7 + context))
        for batch_size in batches:
            batch = DecodeBatch(engine)
            params = SamplingParams(max_tokens=steps + 2, stop_on_eos=False)
            for i in range(batch_size):
                copy = Prefilled(base.tokens, _copy_kv(engine, base.kv), base.logits, 0)
                batch.add(str(i), copy, params)
            times = [speed.seconds(batch.step, dev) for _ in range(steps)]
            seconds = statistics.median(times[1:])
            for i in range(batch_size):  # its pages back before the next point
                batch.cancel(str(i))
            log(f"decode batch {batch_size}, context {context}: {seconds * 1e3:.2f} ms/step")
            rows.append(
                {"batch": batch_size, "context_tokens": batch_size * context, "seconds": seconds}
            )
        base.kv.release()
    return rows


def pool_tokens_for(
    prompts: Sequence[int],
    batches: Sequence[int],
    contexts: Sequence[int],
    block_tokens: int,
    reps: int,
    context: int = 0,
) -> int:
    """KV positions the grids hold at once: a decode point's batch of copies of one context
    (each growing by `reps` + 1 steps) plus that context's own prefill, or a prefill point's
    prompt plus the cached blocks it starts from; a block and a page of slack each. Never
    fewer than an engine's pool may hold for a model of `context` positions."""
    longest = max([*prompts, *contexts], default=0) + 2 * block_tokens + reps + 16
    grid = (max(batches, default=1) + 2) * longest
    return max(grid, min_pool_tokens(context, block_tokens))


def profile_engine(
    engine: Engine,
    *,
    model_name: str,
    prompts: Sequence[int] = DEFAULT_PROMPTS,
    cached: Sequence[int] = DEFAULT_CACHED,
    batches: Sequence[int] = DEFAULT_BATCHES,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    reps: int = 3,
    log: Log = lambda _: None,
) -> dict[str, Any]:
    """A `mooncake.profile/1` document for `engine` over the given grids."""
    if reps < 1:
        raise EngineError("reps must be at least 1")
    if not prompts or not batches or not contexts or any(b < 1 for b in batches):
        raise EngineError("the prefill and decode grids need at least one point each")
    dev = engine.device
    device = (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"cpu ({torch.get_num_threads()} torch threads)"
    )
    return {
        "schema": PROFILE_SCHEMA,
        "model": model_name,
        "device": f"{device}, {str(engine.model.dtype).removeprefix('torch.')}, "
        f"{'quantized' if engine.model.quantized() else 'float32'} weights, "
        f"{engine.decode_path} decode, {engine.prefill_attention} prefill attention, "
        f"{engine.prefill_gemm} prefill GEMMs",
        "prefill": profile_prefill(engine, prompts, cached, reps, log),
        "decode": profile_decode(engine, batches, contexts, reps, log),
    }


# What a worker times at start for the Conductor's cost model (EngineSettings.calibrate):
# few and small, so a start is not held up, and two sizes apart, so a fit has a slope.
# Three sizes: the third shows the attention's share of a long prompt (online_cost).
CALIBRATION_PROMPTS = (64, 512, 2048)
CALIBRATION_BATCHES = (1, 4)
CALIBRATION_CONTEXT = 256


def calibrate(engine: Engine, role: str) -> list[tuple[int, int, float]]:
    """The engine timed as `role` runs it: (prompt, cached, seconds) prefills or (batch,
    context tokens, seconds) decode steps, one warm-up and one timing each (the profile's
    own grids, smaller). Sizes the model's context or the KV pool cannot take are left out
    (decode contexts shrink to a quarter of the pool): a calibration never stops a worker."""
    quiet: Log = lambda _msg: None  # noqa: E731
    rows: list[tuple[int, int, float]] = []
    if role == "prefill":
        for n in CALIBRATION_PROMPTS:
            try:
                got = profile_prefill(engine, (n,), (0,), 1, quiet)
            except Exception as exc:  # too long for this model or pool: leave it out
                log.debug("calibration prefill of %d tokens skipped: %s", n, exc)
                continue
            rows += [(r["prompt_tokens"], r["cached_tokens"], r["seconds"]) for r in got]
        return [r for r in rows if r[2] > 0]
    room = engine.pool.capacity_tokens // (4 * (max(CALIBRATION_BATCHES) + 1))
    context = min(CALIBRATION_CONTEXT, room)
    if context < 16:
        return rows
    try:
        got = profile_decode(engine, CALIBRATION_BATCHES, (context,), 1, quiet)
    except Exception as exc:
        log.debug("calibration decode steps skipped: %s", exc)
        return rows
    rows += [(r["batch"], r["context_tokens"], r["seconds"]) for r in got]
    return [r for r in rows if r[2] > 0]
