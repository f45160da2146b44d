"""Building the engine and tokenizer a worker runs, from settings (one place for all roles)."""

from __future__ import annotations

import logging
import time

import torch

from mooncake import events as ev
from mooncake import memory
from mooncake.config import Settings, resolve_precision
from mooncake.cpus import format_cpus, parse_cpus, pin_process
from mooncake.engine import Engine, compute, dummy_model, gemm, paged
from mooncake.engine import SamplingParams as EngineSampling
from mooncake.engine.errors import EngineError
from mooncake.engine.profile import calibrate
from mooncake.engine.speed import FASTER
from mooncake.engine.turns import NO_TURNS, CoreTurns, Side, Turns
from mooncake.model_info import dummy_spec
from mooncake.serving.cpp_group import inbox_bytes_bound
from mooncake.work import EngineTiming

log = logging.getLogger("mooncake.engine")


def kv_budget_bytes(settings: Settings) -> int:
    """The KV pool's budget: configured, or derived from the machine (`mooncake.memory`)."""
    if settings.kv_cache_bytes is not None:
        return int(settings.kv_cache_bytes)
    return memory.default_kv_cache_bytes(memory.machine_memory(), settings.engine_workers_per_host)


def build_engine(settings: Settings, role: Side | None = None) -> Engine:
    """The configured model on the configured device with its KV pool (EngineError on a bad
    model file, or a budget that cannot hold one full context); `role`: the worker's, whose
    side of the host's turns the engine takes where `engine.turns_dir` is set."""
    s = settings.engine
    pinned = pin_engine(s.cpus)
    threads = s.threads if s.threads is not None else len(pinned) if pinned else None
    if threads is not None:
        torch.set_num_threads(threads)
    memory.keep_heap_small()
    if s.model == "dummy":
        model, tokenizer = dummy_model(dummy_spec(s), device=s.device), None
    else:
        from mooncake.engine.gguf_loader import load_gguf, smollm2_path

        loaded = load_gguf(s.gguf_path or smollm2_path(), device=s.device, weights=s.weights)
        model, tokenizer = loaded.model, loaded.tokenizer
    model.pack_weights()  # on the CPU: one (packed) copy of the weights, not two
    memory.release_free_heap()  # what dequantizing and packing the weights left in the heap
    turns: Turns = NO_TURNS
    if role is not None and s.turns_dir is not None and model.device.type == "cpu":
        turns = CoreTurns(s.turns_dir, role, s.turn_quantum_s)
        log.info("engine: takes turns at this host's CPUs (%s, %s side, quantum %.0f ms)",
                 s.turns_dir, role, s.turn_quantum_s * 1e3)  # fmt: skip
    # The bfloat16 probes time kernels against each other: inside a turn, so that another
    # engine of this host starting at the same time does not decide for them (its probes,
    # its KV pool's first touch).
    with turns.turn():
        engine = Engine(
            model,
            tokenizer,
            block_tokens=settings.block_tokens,
            hash_seed=settings.hash_seed,
            model_id=settings.model_id,
            kv_budget_bytes=kv_budget_bytes(settings),
            decode=s.decode,
            # The dummy model computes exactly (float32) unless bfloat16 is asked for.
            attention=resolve_precision(s.attention, exact=s.model == "dummy"),
            gemm=resolve_precision(s.gemm, exact=s.model == "dummy"),
            kv=s.kv_precision,
        )
        engine.prefill_attention  # noqa: B018 - chosen (measured) now
        # In the turn too (the two sides map theirs one after the other): it takes a CPU the
        # other side's probes time on.
        if s.prefault_kv:
            t0 = time.perf_counter()
            engine.pool.prefault()
            log.info("engine: KV pool mapped in %.1f s", time.perf_counter() - t0)
    engine.turns = turns
    # Prefill and decode workers embed a store node whose DRAM segment they hold too.
    spec = engine.spec
    inbox = inbox_bytes_bound(settings, spec.hidden, spec.vocab_size)
    log.info("%s", memory_statement(engine, settings.store.dram_bytes, inbox))
    kept = "quantized blocks" if model.quantized() else "float32"
    where = f", pinned to CPUs {format_cpus(pinned)}" if pinned else ""
    log.info("engine: weights as %s, %s decode steps, %s prefill attention, %s prefill "
             "GEMMs, %s KV, %d threads%s", kept, engine.decode_path, engine.prefill_attention,
             engine.prefill_gemm, str(engine.pool.dtype).removeprefix("torch."),
             torch.get_num_threads(), where)  # fmt: skip
    if s.attention == "bfloat16" and not engine.prefill_attention.endswith("bfloat16"):
        native_kernel = engine.prefill_attention != "torch"
        dim, page = spec.head_dim, engine.pool.page_tokens
        speeds = (
            [paged.bf16_attention_speedup(dim, page), paged.torch_bf16_attention_speedup(dim, page)]
            if native_kernel
            else []
        )
        speed = max((x for x in speeds if x is not None), default=None)
        log.warning("engine.attention = bfloat16, but %s: float32",
                    "this machine has no bfloat16 prefill attention for this model (AVX512_BF16 "
                    "or AMX, a head of a multiple of 32 floats, a CPU)" if speed is None else
                    f"its bfloat16 prefill attention ran at best {speed:.2f}x as fast as "
                    f"float32's here (measured at start; it must be {FASTER}x)")  # fmt: skip
    if s.gemm == "bfloat16" and engine.prefill_gemm != "bfloat16":
        applies = engine.device.type == "cpu" and bool(model.quantized())
        speed = gemm.bf16_gemm_speedup() if applies else None
        log.warning("engine.gemm = bfloat16, but %s: float32",
                    "this machine has no bfloat16 matrix instructions for it (AMX or "
                    "AVX512_BF16 on a CPU, weights kept quantized)" if speed is None else
                    f"its bfloat16 GEMMs ran {speed:.2f}x as fast as float32's here "
                    f"(measured at start; they must be {FASTER}x)")  # fmt: skip
    return engine


def pin_engine(cpus: str | None) -> tuple[int, ...]:
    """Pin this process to the `engine.cpus` list (mooncake/cpus.py), before torch starts
    its threads where it has not yet; the CPUs, or () where none are set. EngineError
    where the list cannot be pinned to here (CPUs outside this process's set)."""
    if cpus is None:
        return ()
    wanted = parse_cpus(cpus)
    try:
        pin_process(wanted)
    except ValueError as exc:
        raise EngineError(f"engine.cpus {cpus}: {exc}") from None
    return wanted


def warm_decode(engine: Engine, max_batch: int) -> int:
    """On a GPU, capture the decode step of every batch bucket up to `max_batch` now (at the
    narrowest block-table width), so the first requests do not wait for captures; wider
    tables are captured when first met. Returns how many were captured (0 off CUDA)."""
    if engine.graphs is None:
        return 0
    from mooncake.engine.graphs import BATCH_BUCKETS, MIN_WIDTH

    sizes = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
    return engine.graphs.warm(sizes, pages=MIN_WIDTH, say=log.info)


def weights_bytes(engine: Engine) -> int:
    """What the model's weights occupy (on the CPU: the packed copies, the embedding)."""
    return engine.model.weight_bytes()


def memory_statement(engine: Engine, segment_bytes: int = 0, inbox_bytes: int = 0) -> str:
    """The budget a worker states at start: what it holds and the bound it keeps to
    (`inbox_bytes`: its CPP activation inboxes, where groups are on)."""
    pool, mib = engine.pool, memory.MIB
    weights = weights_bytes(engine)
    bound = memory.bound_bytes(weights, pool.budget_bytes, segment_bytes + inbox_bytes)
    inbox = f" + CPP inbox {inbox_bytes / mib:.0f} MiB" if inbox_bytes else ""
    return (
        f"memory: weights {weights / mib:.0f} MiB + KV pool {pool.budget_bytes / mib:.0f} MiB "
        f"({pool.capacity_tokens:,} tokens in {pool.pages.total:,} pages of "
        f"{pool.page_tokens}) + store segment {segment_bytes / mib:.0f} MiB{inbox} + other "
        f"{memory.OTHER_ALLOWANCE / mib:.0f} MiB = bound {bound / mib:.0f} MiB"
    )


def engine_params(p: ev.SamplingParams) -> EngineSampling:
    """A request's sampling parameters as the engine takes them."""
    return EngineSampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
    )


async def calibrate_engine(engine: Engine, settings: Settings, role: str) -> list[EngineTiming]:
    """The engine's timings at worker start, for the load reports (the Conductor's cost
    model starts from them, core/online_cost.py); none when `engine.calibrate` is off.
    Runs before the worker takes work: nothing else uses the engine meanwhile."""
    if not settings.engine.calibrate:
        return []
    t0 = time.perf_counter()

    def alone() -> list[tuple[int, int, float]]:  # the host's other engines wait meanwhile
        with engine.turns.turn():
            return calibrate(engine, role)

    rows = await compute.run(alone)
    timed = [EngineTiming(x=x, z=z, seconds=s) for x, z, s in rows]
    shown = ", ".join(f"{t.x}/{t.z}: {t.seconds * 1e3:.1f} ms" for t in timed)
    log.info("engine timed for the Conductor in %.1f s (%s)", time.perf_counter() - t0, shown)
    return timed
