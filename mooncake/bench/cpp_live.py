"""`mooncake bench cpp --live`: chunked pipeline parallelism through the running system.

`mooncake bench cpp` times the pipeline between bare stage processes. This runs `mooncake
up`'s stack of its own (private broker and database; recorder, store master, Conductor, two
prefill workers and one decode worker, each with one torch thread) and asks one long prompt
twice, as a client does over the bus:

1. with the Conductor's groups off (`cpp.max_stages` 1): one prefill instance prefills it;
2. with groups of two (the Conductor restarted with `cpp.max_stages` 2): both prefill
   instances, as the stages of one group (serving/cpp_group.py).

The two asks name different cache namespaces, so the second finds nothing of the first
cached, and compute the same answer. TTFT is the client's (submission to the first token),
`prefill_s` the leader's own time (`request.prefilled`), `cpu_N_s` the CPU seconds every
process of the stack spent during each ask (two vCPUs here: what the rest of the system
takes during a group's prefill is taken from its stages). `min_efficiency` is lowered from
the default 0.95 because an 8,192-token prompt in chunks of 1,024 keeps at most 8/9 of two
stages busy (the pipeline's fill): the default would never group it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake.bench.memory import ENGINE_ROLES, live_settings, private_settings, wait_ready
from mooncake.config import Settings
from mooncake.stack import Stack

Log = Callable[[str], None]
LAYOUT = (("recorder", 1), ("store-master", 1), ("conductor", 1), ("prefill", 2), ("decode", 1))


@dataclass(frozen=True)
class LiveCppOptions:
    prompt_tokens: int = 8192
    chunk_tokens: int = 1024
    min_efficiency: float = 0.8
    min_gain: float = 1.2  # the default's
    max_tokens: int = 4
    timeout_s: float = 900.0


def cpp_env(opts: LiveCppOptions, max_stages: int) -> dict[str, str]:
    return {
        "MOONCAKE_CPP__MAX_STAGES": str(max_stages),
        "MOONCAKE_CPP__CHUNK_TOKENS": str(opts.chunk_tokens),
        "MOONCAKE_CPP__MIN_EFFICIENCY": str(opts.min_efficiency),
        "MOONCAKE_CPP__MIN_GAIN": str(opts.min_gain),
    }


async def run_live_cpp_bench(
    settings: Settings, opts: LiveCppOptions, log: Log = print
) -> dict[str, Any]:
    from mooncake.bench.cpp import bench_prompt
    from mooncake.model_info import model_spec

    spec = model_spec(settings.engine)
    if opts.prompt_tokens + opts.max_tokens > spec.context:
        raise ValueError(
            f"a prompt of {opts.prompt_tokens} tokens and {opts.max_tokens} more exceeds the "
            f"context of {spec.context}"
        )
    if opts.prompt_tokens <= opts.chunk_tokens:
        raise ValueError("a prompt of one chunk is never grouped: make it longer")
    prompt = bench_prompt(opts.prompt_tokens, spec.vocab_size)
    tmp, private = private_settings(settings, "cpp-live")
    # One-thread stages, as `bench cpp` measures them: a group of two splits the cores.
    one_thread = private.engine.model_copy(update={"threads": 1})
    private = private.model_copy(
        update={"admission_policy": "none", "log_level": "WARNING", "engine": one_thread}
    )
    stack = Stack(private, layout=LAYOUT, inherit_env=False)
    stack.role_env = {"prefill": cpp_env(opts, 2), "conductor": cpp_env(opts, 1)}
    started = time.monotonic()
    ok = False
    try:
        log(f"cpp --live: starting the stack under {tmp}")
        await asyncio.to_thread(stack.start_infrastructure)
        stack.start_workers()
        result = await _measure(live_settings(private, stack), stack, prompt, opts, log)
        ok = True
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} (logs in {tmp / 'logs'})") from exc
    finally:
        await asyncio.to_thread(stack.stop)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    result["took_s"] = round(time.monotonic() - started, 1)
    return result


async def _measure(
    settings: Settings, stack: Stack, prompt: list[int], opts: LiveCppOptions, log: Log
) -> dict[str, Any]:
    from mooncake.bus.connection import connect

    ns = ev.Namespace(settings.namespace)
    engines = {w.name for w in stack.workers if w.role in ENGINE_ROLES}
    nc = await connect(settings, "bench-cpp-live", connect_timeout=5, max_reconnect_attempts=5)
    facts: dict[str, ev.RequestPrefilled] = {}

    async def on_prefilled(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            event = ev.parse_event(msg.data)
            if isinstance(event, ev.RequestPrefilled):
                facts[event.request_id] = event

    sub = await nc.subscribe(ns.of(ev.RequestPrefilled), cb=on_prefilled)
    run = secrets.token_hex(3)
    out: dict[str, Any] = {
        "model": settings.engine.model, "prompt_tokens": len(prompt),
        "chunk_tokens": opts.chunk_tokens, "min_efficiency": opts.min_efficiency,
        "threads_per_worker": 1, "cpu_count": os.cpu_count(),
    }  # fmt: skip
    answers: dict[int, list[int]] = {}
    try:
        await wait_ready(nc, ns, engines, 600.0)
        for stages in (1, 2):
            if stages == 2:
                log("cpp --live: the Conductor again, with groups of two")
                stack.role_env["conductor"] = cpp_env(opts, 2)
                stack.restart(stack.worker("conductor-0"))
                await wait_ready(nc, ns, engines, 120.0)
            rid = f"cpp-live-{run}-{stages}"
            log(f"cpp --live: {len(prompt):,} tokens, groups of up to {stages}")
            before = cpu_seconds(stack)
            answer = await _ask(nc, ns, prompt, rid, f"bench-cpp-{run}-{stages}", opts)
            spent = {k: v - before.get(k, 0.0) for k, v in cpu_seconds(stack).items()}
            out[f"cpu_{stages}_s"] = {k: round(v, 1) for k, v in sorted(spent.items())}
            answers[stages] = answer.token_ids
            fact = await _fact(facts, rid)
            out[f"live_ttft_{stages}_s"] = round(answer.ttft_s or 0.0, 3)
            out[f"live_prefill_{stages}_s"] = round(fact.prefill_s, 3)
            out[f"stages_{stages}"] = list(fact.stages)
            if fact.cpp_fallback:
                out[f"cpp_fallback_{stages}"] = fact.cpp_fallback
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        await nc.drain()
    if len(out["stages_2"]) != 2:
        why = out.get("cpp_fallback_2", "the Conductor did not choose a group")
        raise RuntimeError(f"the second ask was not prefilled by a group of two: {why}")
    out["live_speedup_2"] = round(out["live_ttft_1_s"] / out["live_ttft_2_s"], 3)
    out["prefill_speedup_2"] = round(out["live_prefill_1_s"] / out["live_prefill_2_s"], 3)
    out["same_answer"] = answers[1] == answers[2]
    out["checks_passed"] = out["same_answer"]
    return out


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) each process of the stack has spent: the workers, the
    broker and the database with its backends. On two vCPUs whatever else runs during a
    group's prefill is taken from its stages."""
    import psutil

    out = {name: u.cpu_s for name, u in stack.usage().items()}
    for name, proc in (("nats-server", stack.nats), ("postgres", stack.postgres)):
        if proc is None or proc.proc is None:
            continue
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(proc.proc.pid)
            total = 0.0
            for p in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
            out[name] = total
    return out


async def _ask(
    nc: Any, ns: ev.Namespace, prompt: list[int], rid: str, cache: str, opts: LiveCppOptions
) -> Any:
    from mooncake.client import ask

    answer = await ask(
        nc, token_ids=prompt, ns=ns, request_id=rid, cache_namespace=cache,
        params=ev.SamplingParams(max_tokens=opts.max_tokens), timeout_s=opts.timeout_s,
    )  # fmt: skip
    if not answer.finished or answer.ttft_s is None:
        raise RuntimeError(f"{rid} did not complete: {answer.finish_reason} {answer.error}")
    return answer


async def _fact(facts: dict[str, ev.RequestPrefilled], rid: str) -> ev.RequestPrefilled:
    deadline = time.monotonic() + 30
    while rid not in facts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no request.prefilled of {rid} within 30 s")
        await asyncio.sleep(0.1)
    return facts[rid]
