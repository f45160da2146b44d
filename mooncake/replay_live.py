"""`mooncake replay TRACE.jsonl`: a Mooncake trace against the live system.

Each trace line becomes a real request: its hash ids become deterministic block tokens
(`mooncake.trace.request_tokens`), so requests that share hash ids share a token prefix and
therefore KV blocks, exactly as in the trace. Lengths are scaled to fit a CPU: a trace block
(512 tokens) becomes `tokens_per_block` tokens, and the output length likewise, capped.
Prompts that would not fit the model's context (with their output) are fitted to it first
(`mooncake.trace_fit`; the summary's `fitted` says how many were changed or skipped).
Requests are submitted at their trace timestamps divided by `speed`, all in flight at once,
and the summary is built from what the clients saw plus the prefill events (cache hits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake.bus.connection import connect
from mooncake.client import Outcome, ask, check_admitting
from mooncake.config import Settings
from mooncake.core.quantile import percentiles
from mooncake.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace, request_tokens
from mooncake.trace_fit import FitMode, fit_trace

Progress = Callable[[Outcome], None]


@dataclass(frozen=True)
class LiveReplayOptions:
    trace: Path
    speed: float = 1.0
    limit: int | None = None
    tokens_per_block: int = 16
    max_output_tokens: int = 32
    vocab_size: int = 49152
    timeout_s: float = 300.0
    # The model's context, to fit prompts to (None: sent as the trace has them), and how.
    context_tokens: int | None = None
    fit: FitMode = FitMode.SCALE
    # Request ids are `<id_prefix>-<i>`, i counting the requests sent (default: replay-<time>).
    id_prefix: str | None = None


def max_tokens(req: TraceRequest, opts: LiveReplayOptions) -> int:
    """The request's output length, scaled like its blocks and capped."""
    out = math.ceil(req.output_length * opts.tokens_per_block / TRACE_BLOCK_TOKENS)
    return max(1, min(opts.max_output_tokens, out))


def scaled_request(
    req: TraceRequest, opts: LiveReplayOptions, seed: int
) -> tuple[list[int], ev.SamplingParams]:
    tokens = request_tokens(
        req, vocab_size=opts.vocab_size, tokens_per_block=opts.tokens_per_block, seed=seed
    )
    return tokens, ev.SamplingParams(max_tokens=max_tokens(req, opts))


def fitted_trace(opts: LiveReplayOptions) -> tuple[list[TraceRequest], dict[str, object] | None]:
    """The requests to send (TraceError, a ValueError, for a bad file), and what fitting
    them to the context did (None without a context)."""
    trace = load_trace(opts.trace, limit=opts.limit)
    if opts.context_tokens is None:
        return trace, None
    fitted = fit_trace(
        trace,
        context_tokens=opts.context_tokens,
        max_tokens=lambda r: max_tokens(r, opts),
        tokens_per_block=opts.tokens_per_block,
        mode=opts.fit,
    )
    return fitted.requests, fitted.summary()


def summarize(
    outcomes: list[Outcome],
    prefilled: dict[str, dict[str, Any]],
    settings: Settings,
    wall_s: float,
) -> dict[str, Any]:
    rejected = Counter(
        o.rejected_reason or "unknown" for o in outcomes if o.rejected_reason is not None
    )
    completed = [o for o in outcomes if o.finished]
    prompt = sum(int(p.get("prompt_tokens", 0)) for p in prefilled.values())
    cached = sum(int(p.get("cached_tokens", 0)) for p in prefilled.values())
    remote = sum(int(p.get("remote_cached_tokens", 0)) for p in prefilled.values())
    slo = settings.slo
    good = [o for o in completed if slo.met_by(o.ttft_s, o.tbt_s)]
    return {
        "requests": len(outcomes),
        "admitted": sum(o.admitted for o in outcomes),
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(rejected),
        "completed": len(completed),
        "cancelled": sum(o.finish_reason == "cancelled" for o in outcomes),
        "failed": sum(o.finish_reason == "failed" for o in outcomes),
        "unfinished": sum(o.admitted and o.finish_reason is None for o in outcomes),
        "ttft_s": percentiles([o.ttft_s for o in completed if o.ttft_s is not None], digits=4),
        "tbt_s": percentiles([o.tbt_s for o in completed if o.tbt_s is not None], digits=4),
        "output_tokens": sum(len(o.tokens) for o in completed),
        "prompt_tokens": prompt,
        "hit_rate": {
            "local": round((cached - remote) / prompt, 4) if prompt else 0.0,
            "remote": round(remote / prompt, 4) if prompt else 0.0,
            "total": round(cached / prompt, 4) if prompt else 0.0,
            "cached_tokens": cached,
            "remote_tokens": remote,
        },
        "goodput_req_s": round(len(good) / wall_s, 3) if wall_s > 0 else 0.0,
        "wall_s": round(wall_s, 2),
    }


async def run_live_replay(
    settings: Settings,
    opts: LiveReplayOptions,
    on_done: Progress | None = None,
    *,
    check_system: bool = False,
) -> dict[str, Any]:
    """Replay the trace against the live system. `check_system`: first make sure a Conductor
    takes submissions (`client.SystemDown` if none does), as the CLI does."""
    if opts.speed <= 0:
        raise ValueError("--speed must be > 0")
    if opts.limit is not None and opts.limit < 1:
        raise ValueError("--limit must be at least 1")
    trace, fitted = fitted_trace(opts)
    if not trace:
        raise ValueError(f"{opts.trace} holds no requests" + (" that fit" if fitted else ""))
    ns = ev.Namespace(settings.namespace)
    nc = await connect(settings, "replay", connect_timeout=3, max_reconnect_attempts=3)
    if check_system:
        try:
            await check_admitting(nc, ns)
        except BaseException:
            await nc.close()
            raise
    prefilled: dict[str, dict[str, Any]] = {}

    async def on_prefilled(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            body = json.loads(msg.data)
            prefilled[str(body.get("request_id"))] = body

    sub = await nc.subscribe(ns.of(ev.RequestPrefilled), cb=on_prefilled)
    try:
        start = time.monotonic()
        t0 = trace[0].arrival_s
        prefix = opts.id_prefix or f"replay-{int(time.time())}"
        ids = [f"{prefix}-{i}" for i in range(len(trace))]

        async def one(i: int, req: TraceRequest) -> Outcome:
            delay = (req.arrival_s - t0) / opts.speed - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tokens, params = scaled_request(req, opts, settings.hash_seed)
            out = await ask(
                nc, token_ids=tokens, params=params, ns=ns, request_id=ids[i],
                timeout_s=opts.timeout_s,
            )  # fmt: skip
            if on_done is not None:
                on_done(out)
            return out

        outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
        wall = time.monotonic() - start
        await asyncio.sleep(0.2)  # the last prefill events
        mine = {rid: prefilled[rid] for rid in ids if rid in prefilled}
        result = summarize(list(outcomes), mine, settings, wall)
        if fitted is not None:
            result["fitted"] = fitted
        return result
    finally:
        await sub.unsubscribe()
        await nc.drain()
