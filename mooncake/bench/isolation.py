"""`mooncake bench isolation`: the shared KV pool as a side channel between tenants, measured
with the real roles (issue 20).

`mooncake up`'s stack (`mooncake.stack.Stack`: embedded NATS and Postgres in a temporary
directory, the recorder, store master, Conductor, 2 prefill and 2 decode workers) runs; once
every engine instance reports, each of `prompts` long prompts (random token ids, a few whole
blocks and a partial one) is sent, one request after the other:

1. by tenant A (`a_cold`: nothing of it is cached anywhere);
2. by tenant B, the same prompt (`cross`: what B can learn of A's prompts through the pool);
3. by tenant A again (`a_warm`: the pool does serve A its own blocks, in this run);
4. by tenants C then D, both naming the shared cache namespace (`shared_first`,
   `shared_second`: an opt-in namespace shares as a plain pool does).

The figures come from the record (`requests.cached_tokens`: what each prefill reused) and
from the client (TTFT). `cross_tenant_cached_tokens` must be 0, B's TTFT cold-level (nearer
A's cold TTFT than A's warm one), and the warm and shared requests must have hit.

Then the flood (`FloodOptions`, unless `flood=None`): two calm tenants send short prompts at a
steady rate, first alone for `seconds`, then for as long again beside a third tenant sending
at `factor` times one calm tenant's rate. The rates come from a lone request's TTFT: the
flood alone asks for `overload` times what the prefill pool can do (its instances over that
TTFT), one calm tenant for a `factor`-th of that. `others_goodput_ratio`: the calm tenants'
goodput (requests finished within the settings' TTFT and TBT SLOs) beside the flood over
alone; the flood's rejections by reason (`tenant_quota` where the shares bound,
core/tenancy.py).
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake import events as ev
from mooncake.bench.memory import (
    ENGINE_ROLES,
    keep_logs_if_failed,
    live_settings,
    private_settings,
    wait_ready,
)
from mooncake.bench.record import read_record, rows
from mooncake.config import SLO, Settings
from mooncake.stack import Stack

Log = Callable[[str], None]
KINDS = ("a_cold", "cross", "a_warm", "shared_first", "shared_second")
TENANTS = {  # kind -> (tenant, shared namespace)
    "a_cold": ("bench-a", None),
    "cross": ("bench-b", None),
    "a_warm": ("bench-a", None),
    "shared_first": ("bench-c", "bench-shared"),
    "shared_second": ("bench-d", "bench-shared"),
}


@dataclass(frozen=True)
class FloodOptions:
    seconds: float = 90.0  # each phase's arrivals
    factor: float = 10.0  # the flood's rate over one calm tenant's
    overload: float = 1.2  # the flood's rate over the prefill pool's (from a lone TTFT)
    prompt_tokens: int = 200
    max_tokens: int = 8


@dataclass(frozen=True)
class IsolationOptions:
    prompts: int = 4
    blocks: int = 4  # whole blocks of each prompt (plus a partial one)
    max_tokens: int = 2
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    flood: FloodOptions | None = FloodOptions()


def bench_prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids (0 .. 255 skipped: no special ids), none sharing a
    first block with another or with any earlier run's (`seed`)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256, vocab) for _ in range(tokens)] for _ in range(n)]


async def run_isolation_bench(
    settings: Settings, opts: IsolationOptions, log: Log = print
) -> dict[str, Any]:
    """The run (see the module doc) on a stack of its own: `settings` as `mooncake up` takes
    them, their broker, database and data directory replaced by private ones."""
    from mooncake.model_info import model_spec

    if opts.prompts < 1 or opts.blocks < 1 or opts.max_tokens < 1:
        raise ValueError("--prompts, --blocks and --max-tokens must be at least 1")
    spec = model_spec(settings.engine)
    length = opts.blocks * settings.block_tokens + settings.block_tokens // 2
    if length + opts.max_tokens > spec.context:
        raise ValueError(
            f"{opts.blocks} blocks of {settings.block_tokens} tokens and the answer exceed "
            f"the model's context of {spec.context}"
        )
    prompts = bench_prompts(opts.prompts, length, spec.vocab_size, secrets.randbits(32))
    tmp, private = private_settings(settings, "isolation")
    stack = Stack(private)
    started = time.monotonic()
    try:
        log(f"isolation: starting the stack under {tmp}")
        await asyncio.to_thread(stack.start_infrastructure)
        stack.start_workers()
        result = await _measure(live_settings(private, stack), stack, prompts, opts, log)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} (logs in {tmp / 'logs'})") from exc
    finally:
        await asyncio.to_thread(stack.stop)
    result.update(prompt_tokens=length, block_tokens=settings.block_tokens)
    result["took_s"] = round(time.monotonic() - started, 1)
    return keep_logs_if_failed(result, tmp)


async def _measure(
    settings: Settings, stack: Stack, prompts: list[list[int]], opts: IsolationOptions, log: Log
) -> dict[str, Any]:
    from mooncake.bus.connection import connect
    from mooncake.client import ask

    ns = ev.Namespace(settings.namespace)
    engines = {w.name for w in stack.workers if w.role in ENGINE_ROLES}
    nc = await connect(settings, "bench-isolation", connect_timeout=5, max_reconnect_attempts=5)
    ids: dict[str, list[str]] = {k: [] for k in KINDS}
    ttft: dict[str, list[float]] = {k: [] for k in KINDS}
    run = secrets.token_hex(3)
    try:
        await wait_ready(nc, ns, engines, opts.ready_timeout_s)
        log(f"isolation: ready; {len(prompts)} prompts x {len(KINDS)} requests")
        params = ev.SamplingParams(max_tokens=opts.max_tokens, temperature=0.0)
        for i, tokens in enumerate(prompts):
            for kind in KINDS:
                tenant, shared = TENANTS[kind]
                rid = f"iso-{run}-{i}-{kind}"
                out = await ask(
                    nc, token_ids=tokens, ns=ns, params=params, request_id=rid, tenant=tenant,
                    cache_namespace=shared, timeout_s=opts.request_timeout_s,
                )  # fmt: skip
                if not out.finished or out.ttft_s is None:
                    raise RuntimeError(f"{rid} did not complete: {out.finish_reason} {out.error}")
                ids[kind].append(rid)
                ttft[kind].append(out.ttft_s)
            log(f"isolation: prompt {i + 1}: TTFT " + ", ".join(
                f"{k} {ttft[k][-1]:.2f} s" for k in KINDS))  # fmt: skip
        flood = None
        if opts.flood is not None:
            flood = await _flood(nc, ns, settings, stack, opts.flood, run, log)
    finally:
        await nc.drain()
    assert settings.database_url is not None
    every = [rid for kind in KINDS for rid in ids[kind]]
    await read_record(settings.database_url, every, 60.0)
    found = await rows(
        settings.database_url,
        "SELECT request_id, cached_tokens FROM requests WHERE request_id = ANY(%s)",
        every,
    )
    cached = {rid: int(c or 0) for rid, c in found}
    if set(cached) != set(every):
        raise RuntimeError(f"the record lacks {sorted(set(every) - set(cached))[:5]}")
    result = figures(ids, ttft, cached)
    # The headline ratio at the top level too, where scripts read it (null without a flood).
    result["others_goodput_ratio"] = None if flood is None else flood["others_goodput_ratio"]
    if flood is not None:
        result["flood"] = flood
        result["checks"].update(flood["checks"])
        result["checks_passed"] = all(result["checks"].values())
    return result


CALM = ("calm-1", "calm-2")
FLOOD = "flood"


async def _flood(
    nc: Any, ns: ev.Namespace, settings: Settings, stack: Stack, f: FloodOptions, run: str,
    log: Log,
) -> dict[str, Any]:  # fmt: skip
    """The two phases (see the module doc); their figures and checks."""
    from mooncake.client import ask
    from mooncake.model_info import model_spec

    spec_vocab = model_spec(settings.engine).vocab_size
    params = ev.SamplingParams(max_tokens=f.max_tokens, temperature=0.0)
    seq = iter(range(10**9))

    def prompt() -> list[int]:
        import random

        rng = random.Random(f"{run}-{next(seq)}")
        return [rng.randrange(256, spec_vocab) for _ in range(f.prompt_tokens)]

    timeout = 4 * settings.slo.ttft_s + 60.0
    lone = await ask(nc, token_ids=prompt(), ns=ns, params=params, tenant=CALM[0],
                     timeout_s=timeout)  # fmt: skip
    if not lone.finished or lone.ttft_s is None:
        raise RuntimeError(f"a lone flood-shaped request did not complete: {lone.error}")
    pool = sum(1 for w in stack.workers if w.role == "prefill")
    calm_rate = f.overload * pool / lone.ttft_s / f.factor
    log(f"isolation: flood: a lone request's TTFT {lone.ttft_s:.2f} s; calm tenants at "
        f"{calm_rate:.3f}/s each, the flood at {f.factor * calm_rate:.3f}/s")  # fmt: skip

    async def phase(tenants: dict[str, float]) -> dict[str, list[Any]]:
        arrivals = sorted(
            (k / rate, t) for t, rate in tenants.items() for k in range(int(f.seconds * rate))
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks: list[tuple[str, asyncio.Task[Any]]] = []
        for at, tenant in arrivals:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            task = asyncio.create_task(ask(nc, token_ids=prompt(), ns=ns, params=params,
                                           tenant=tenant, timeout_s=timeout))  # fmt: skip
            tasks.append((tenant, task))
        out: dict[str, list[Any]] = {t: [] for t in tenants}
        for tenant, task in tasks:
            out[tenant].append(await task)
        return out

    alone = await phase(dict.fromkeys(CALM, calm_rate))
    log("isolation: flood: the calm tenants alone done; now beside the flood")
    beside = await phase({**dict.fromkeys(CALM, calm_rate), FLOOD: f.factor * calm_rate})
    out = flood_figures(alone, beside, settings.slo.ttft_s, settings.slo.tbt_s, calm_rate)
    out.update(lone_ttft_s=round(lone.ttft_s, 3), prefill_instances=pool,
               flood_rate_per_s=round(f.factor * calm_rate, 4))  # fmt: skip
    return out


def _good(o: Any, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    return bool(o.finished) and SLO(ttft_s=ttft_slo_s, tbt_s=tbt_slo_s).met_by(o.ttft_s, o.tbt_s)


def flood_figures(
    alone: dict[str, list[Any]], beside: dict[str, list[Any]], ttft_slo_s: float,
    tbt_slo_s: float, calm_rate: float,
) -> dict[str, Any]:  # fmt: skip
    """Goodput of the calm tenants alone and beside the flood, the flood's outcomes."""

    def good(outs: list[Any]) -> int:
        return sum(_good(o, ttft_slo_s, tbt_slo_s) for o in outs)

    calm_alone = sum(good(alone[t]) for t in CALM)
    calm_beside = sum(good(beside[t]) for t in CALM)
    reasons: dict[str, int] = {}
    for o in beside.get(FLOOD, []):
        if (why := o.rejected_reason) is not None:
            reasons[why] = reasons.get(why, 0) + 1
    ratio = calm_beside / calm_alone if calm_alone else None
    return {
        "calm_rate_per_s": round(calm_rate, 4),
        "calm_requests": sum(len(alone[t]) for t in CALM),
        "calm_goodput_alone": calm_alone,
        "calm_goodput_beside_flood": calm_beside,
        "others_goodput_ratio": None if ratio is None else round(ratio, 3),
        "flood_requests": len(beside.get(FLOOD, [])),
        "flood_goodput": good(beside.get(FLOOD, [])),
        "flood_rejections": dict(sorted(reasons.items())),
        "checks": {
            "others_goodput_ratio >= 0.9": ratio is not None and ratio >= 0.9,
            "the flood's rejections carry tenant_quota": reasons.get("tenant_quota", 0) > 0,
        },
    }


def figures(
    ids: dict[str, list[str]], ttft: dict[str, list[float]], cached: dict[str, int]
) -> dict[str, Any]:
    """The bench's figures and checks from each kind's request ids, TTFTs and cached tokens."""
    tokens = {k: sum(cached[rid] for rid in ids[k]) for k in KINDS}
    med = {k: statistics.median(ttft[k]) for k in KINDS}
    cold, warm, cross = med["a_cold"], med["a_warm"], med["cross"]
    checks = {
        "cross_tenant_cached_tokens == 0": tokens["cross"] == 0,
        # Cold-level: nearer A's cold TTFT than A's warm one.
        "cross-tenant TTFT cold-level": abs(cross - cold) < abs(cross - warm),
        "the same tenant hits its own blocks": tokens["a_warm"] > 0,
        "a shared namespace hits": tokens["shared_second"] > 0,
        "a shared namespace starts apart from the tenants'": tokens["shared_first"] == 0,
    }
    return {
        "requests_per_kind": len(ids["a_cold"]),
        "cross_tenant_cached_tokens": tokens["cross"],
        "same_tenant_cached_tokens": tokens["a_warm"],
        "shared_cached_tokens": tokens["shared_second"],
        "shared_first_cached_tokens": tokens["shared_first"],
        "cold_cached_tokens": tokens["a_cold"],
        "ttft_median_s": {k: round(v, 4) for k, v in med.items()},
        "cross_over_cold_ttft": round(cross / cold, 3) if cold > 0 else None,
        "warm_over_cold_ttft": round(warm / cold, 3) if cold > 0 else None,
        "checks": checks,
        "checks_passed": all(checks.values()),
    }
