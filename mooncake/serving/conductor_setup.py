"""Settings -> the core's Conductor configuration and cost model (one place for both).

The core (`mooncake.core.conductor`, `admission`, `cost_model`) knows nothing of Settings;
the live worker and anything else that schedules like it (benchmarks, replay) build their
`ConductorConfig` and `Costs` here, so a knob means the same thing everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mooncake.config import PRECISION_BYTES, EngineSettings, Settings
from mooncake.core.conductor import ConductorConfig
from mooncake.core.cost_model import (
    A800_X8,
    H800_X8,
    SSD_LATENCY_S,
    Costs,
    FittedCostModel,
    Sample,
    TransferModel,
    fit_decode,
    fit_prefill,
    profile_samples,
    reference_costs,
)
from mooncake.core.cpp import CppConfig
from mooncake.core.online_cost import OnlineCostModel
from mooncake.core.tenancy import TenantShares

HARDWARE = {"8xA800": A800_X8, "8xH800": H800_X8}
# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims (times the pool element's bytes, engine.kv).
SMOLLM2_KV_ELEMENTS_PER_TOKEN = 2 * 30 * 3 * 64
# SSD reads with a cost profile and no measured speed: one common NVMe drive's sequential
# read (an assumption; `mooncake profile ssd` measures yours).
DEFAULT_SSD_READ_BYTES_PER_S = 2e9


def conductor_config(settings: Settings, layers: int | None = None) -> ConductorConfig:
    """`layers`: the served model's (CPP's stages split them; None: the reference model's)."""
    c, g = settings.conductor, settings.cpp
    cpp = CppConfig(
        max_stages=g.max_stages, chunk_tokens=g.chunk_tokens, min_gain=g.min_gain,
        min_efficiency=g.min_efficiency, **({"layers": layers} if layers else {}),
    )  # fmt: skip
    return ConductorConfig(
        cpp=cpp,
        block_tokens=settings.block_tokens,
        balancing_threshold=c.balancing_threshold,
        pool_fetch=True,
        ttft_slo_s=settings.slo.ttft_s,
        tbt_slo_s=settings.slo.tbt_s,
        uniform_decode_s=c.uniform_decode_s,
        ttft_margin_quantile=c.ttft_margin_quantile,
        max_inflight=c.max_inflight,
        tenants=TenantShares(
            weights=tuple(sorted(c.tenant_weights.items())), contention=c.tenant_contention
        ),
    )


# Measured with tracemalloc (2026-12-02): a request in flight is 714 B of the Conductor's
# state (its ClusterView entry and queue slot, and what `KnownRequests` keeps of it); a block
# key in a KV index 119 B (the key's string and its dict slot; holder sets are interned).
BYTES_PER_INFLIGHT = 768
BYTES_PER_INDEX_KEY = 128


def memory_parts(settings: Settings) -> dict[str, int]:
    """The Conductor's bounded tables at their limits (bytes): the requests in flight
    (`conductor.max_inflight`), its two KV indexes (`max_index_keys` each) and one dead
    instance's work being re-dispatched (each more reaped at once adds as much)."""
    from mooncake.serving.conductor_reaper import REAP_FETCH

    c = settings.conductor
    return {
        "inflight": c.max_inflight * BYTES_PER_INFLIGHT,
        "index": 2 * c.max_index_keys * BYTES_PER_INDEX_KEY,
        "reaping": REAP_FETCH * settings.bus.max_event_bytes,
    }


def kv_bytes_per_token(engine: EngineSettings) -> int:
    """KV bytes one token takes in the served model (K and V, every layer, in the pool's
    element type: EngineSettings.kv)."""
    width = PRECISION_BYTES[engine.kv_precision]
    if engine.model == "dummy":
        d = engine.dummy
        return 2 * d.layers * d.kv_heads * (d.hidden // d.heads) * width
    return SMOLLM2_KV_ELEMENTS_PER_TOKEN * width


def costs_from_profile(doc: dict[str, Any], settings: Settings, hidden: int | None = None) -> Costs:
    """A fitted cost model for the profiled engine; transfers over the store's transport.
    With `conductor.online_cost`, one that refits from the workers' timings, the profile's
    samples kept as its anchor."""
    pre, dec = profile_samples(doc)  # the document is read and checked once
    fitted = FittedCostModel(prefill=fit_prefill(pre), decode=fit_decode(dec))
    c = settings.conductor
    kv_bytes = kv_bytes_per_token(settings.engine)
    transfer = TransferModel(c.transfer_bytes_per_s, c.transfer_latency_s, kv_bytes)
    ssd_speed = c.ssd_read_bytes_per_s or DEFAULT_SSD_READ_BYTES_PER_S
    # A CPP chunk's activations go over the same transport (float32 hidden states).
    act = None
    if hidden:
        act = TransferModel(c.transfer_bytes_per_s, c.transfer_latency_s, hidden * 4)
    costs = Costs(
        fitted, fitted, transfer, ssd=TransferModel(ssd_speed, SSD_LATENCY_S, kv_bytes),
        activation=act,
    )  # fmt: skip
    return _maybe_online(costs, settings, hidden, pre, dec)


def build_costs(settings: Settings, hidden: int | None = None) -> Costs:
    """The configured cost model (reads the profile file: call it at start-up, not per
    request). A profile that cannot be read or fitted is an error, not a silent fallback:
    admission decisions would otherwise rest on the wrong hardware's numbers. `hidden`: the
    served model's hidden size (the online model's prefill shape; None: unknown)."""
    path = settings.conductor.cost_profile
    if path is None:
        ref = reference_costs(HARDWARE[settings.conductor.reference_hardware])
        if (speed := settings.conductor.ssd_read_bytes_per_s) is not None and ref.ssd:
            ref = replace(ref, ssd=replace(ref.ssd, bandwidth_bytes_per_s=speed))
        return _maybe_online(ref, settings, hidden)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    return costs_from_profile(doc, settings, hidden)


def _maybe_online(
    seed: Costs,
    settings: Settings,
    hidden: int | None,
    pre: Sequence[Sample] = (),
    dec: Sequence[Sample] = (),
) -> Costs:
    """`seed` as it is, or (`conductor.online_cost`) an online model it seeds, anchored on
    the measured rows `pre` / `dec`."""
    if not settings.conductor.online_cost:
        return seed
    online = OnlineCostModel(
        seed.prefill, seed.decode, prefill_prior=pre, decode_prior=dec, hidden=hidden
    )
    return replace(seed, prefill=online, decode=online)


def online_model(costs: Costs) -> OnlineCostModel | None:
    """The online model inside `costs`, if it is one (the Conductor feeds it)."""
    return costs.prefill if isinstance(costs.prefill, OnlineCostModel) else None
