"""The one definition of every bench's JSON output (`mooncake bench NAME --json`).

Each bench builds a dict (mooncake/bench/*.py, plus `busy_at_start` added for engine and cpp
in commands/bench.py) and prints it as one JSON object. The models here say which keys that
object has, their types and units, and where a key appears only on some runs; `mooncake
bench schema NAME` prints `json_schema(NAME)`, and every bench passes its result through
`validate(NAME, result)` before printing, so a new, renamed or retyped field fails until
this file says so (every model forbids keys it does not declare).

Conventions: a key the code always writes is required; one written on some paths only is
optional (default None) with the condition in its description; `X | None` where the code
writes null. A few keys carry a run's parameter in their name (`speedup_4`, `ttft_p90_s`):
those models declare key patterns (`PatternKeysModel`), checked the same way and printed as
the JSON Schema's `patternProperties`. Validation is strict (no coercion: an int stays an
int; an int is accepted where a float is declared).
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

# --- the bases ------------------------------------------------------------------------------------


class BenchModel(BaseModel):
    """A bench's output object, or a fixed-key part of one: no undeclared key passes."""

    model_config = ConfigDict(extra="forbid", strict=True)


@functools.cache
def _adapter(type_: Any) -> TypeAdapter[Any]:
    return TypeAdapter(type_, config=ConfigDict(strict=True))


def _pattern_properties(schema: dict[str, Any], cls: type[Any]) -> None:
    """The JSON Schema of a `PatternKeysModel`: its key patterns, nothing else extra."""
    patterns: dict[str, tuple[Any, str]] = getattr(cls, "PATTERN_KEYS", {})
    schema["patternProperties"] = {
        f"^{p}$": {**_adapter(t).json_schema(), "description": d} for p, (t, d) in patterns.items()
    }
    schema["additionalProperties"] = False


class PatternKeysModel(BenchModel):
    """A model some of whose keys are named after a run's parameter (a group size, the SLO's
    percentile): besides its fields, a key passes only if it fully matches one of
    `PATTERN_KEYS` (regex -> (the value's type, description)) and its value has that type."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_pattern_properties)
    PATTERN_KEYS: ClassVar[dict[str, tuple[Any, str]]] = {}

    @model_validator(mode="after")
    def _check_pattern_keys(self) -> Self:
        extra = self.__pydantic_extra__ or {}
        for key, value in extra.items():
            for pattern, (type_, _) in self.PATTERN_KEYS.items():
                if re.fullmatch(pattern, key):
                    try:
                        extra[key] = _adapter(type_).validate_python(value)
                    except ValidationError as exc:
                        raise ValueError(f"{key}: {exc.errors()[0]['msg']}") from None
                    break
            else:
                raise ValueError(f"{key}: extra field not permitted (no field or key pattern)")
        return self


# --- shapes shared by several benches -------------------------------------------------------------


class P50P90(BenchModel):
    """A p50 / p90 pair (null with no samples)."""

    p50: float | None = Field(description="Median")
    p90: float | None = Field(description="90th percentile")


class P50P90P99(P50P90):
    """`core.quantile.percentiles`' default {p50, p90, p99} (null with no samples)."""

    p99: float | None = Field(description="99th percentile")


class Slo(BenchModel):
    """A TTFT / TBT service-level objective."""

    ttft_s: float = Field(description="Time-to-first-token limit (s)")
    tbt_s: float = Field(description="Time-between-tokens limit (s)")


class SloAtPercentile(Slo):
    percentile: float = Field(description="Share of requests (0-1) the limits are held at")


# A tenant-, reason- or worker-keyed count: keys are whatever the run saw.
ReasonCounts = dict[str, int]


# --- bus ------------------------------------------------------------------------------------------


class BusResult(BenchModel):
    """`mooncake bench bus`: recorder throughput into Postgres, 3-hop relay latency."""

    events: int = Field(description="RequestSubmitted events of the recorder run")
    relays: int = Field(description="Messages timed through each 3-hop relay")
    nats_server_version: str = Field(description="Version of the private nats-server")
    core_nats_relay_p50_ms: float = Field(description="Core NATS (no persistence) relay p50 (ms)")
    core_nats_relay_p99_ms: float = Field(description="Core NATS relay p99 (ms)")
    raw_relay_p50_ms: float = Field(description="Bare nats-py JetStream relay p50 (ms)")
    raw_relay_p99_ms: float = Field(description="Bare nats-py JetStream relay p99 (ms)")
    lifecycle_relay_p50_ms: float = Field(description="The project's bus layer relay p50 (ms)")
    lifecycle_relay_p99_ms: float = Field(description="The project's bus layer relay p99 (ms)")
    relay_ratio: float = Field(description="lifecycle p50 / raw p50")
    recorded_events_per_s: float = Field(description="Events recorded per second (publish->row)")
    recorded_seconds: float = Field(description="First publish until every event is a row (s)")
    published_events_per_s: float = Field(description="Events published per second")
    recorder_batch: int = Field(description="settings.recorder_batch of the recorder")
    cpus: int | None = Field(description="os.cpu_count()")
    python: str = Field(description="Python version")


# --- store ----------------------------------------------------------------------------------------


class _StoreRow(BenchModel):
    size: int = Field(description="Object size (bytes)")
    put_gbps: float = Field(description="Put throughput over all bytes moved (GB/s, 1e9)")
    get_gbps: float = Field(description="Get throughput over all bytes moved (GB/s)")
    baseline_gbps: float = Field(description="Same-run baseline, median of the blocks (GB/s)")
    ratio: float = Field(description="min(put, get) / baseline")


class StoreTcpRow(_StoreRow):
    transport: Literal["tcp"] = Field(description="Store transport")
    baseline_one_buffer_gbps: float = Field(
        description="tcp baseline into one buffer (cache-hot for small objects) (GB/s)"
    )


class StoreShmRow(_StoreRow):
    transport: Literal["shm"] = Field(description="Store transport")
    baseline_anon_gbps: float = Field(description="memcpy into anonymous memory (GB/s)")


StoreRow = Annotated[StoreTcpRow | StoreShmRow, Field(discriminator="transport")]


class StoreResult(BenchModel):
    """`mooncake bench store`: put/get GB/s per transport and size, 4 KiB op rates."""

    segment_bytes: int = Field(description="The node's DRAM segment (bytes)")
    total_bytes: int = Field(description="Bytes moved per transport and object size")
    reps: int = Field(description="Blocks per size, each with its own baselines")
    results: list[StoreRow] = Field(description="One row per object size and transport")
    small_exists_ops_per_s: int = Field(description="Batched 4 KiB exists (ops/s)")
    small_get_ops_per_s: int = Field(description="Batched 4 KiB gets (ops/s)")
    small_ops_per_s: int = Field(description="The lower of the two (ops/s)")
    node_rss_bytes: int = Field(description="The store node's RSS at the end (bytes)")
    node_rss_over_segment_mb: float = Field(description="Node RSS beyond its segment (MiB)")
    cpus: int | None = Field(description="os.cpu_count()")


# --- index ----------------------------------------------------------------------------------------


class IndexFault(BenchModel):
    """One fault's figures, from its end (the workload paused)."""

    resync_s: float = Field(description="Until every node EXACT and the index holds the truth (s)")
    exact_s: float = Field(description="Until every node merely says EXACT (s)")
    master_caught_up_s: float = Field(description="Until the master lists what nodes hold (s)")
    decisions_resyncing: int = Field(description="Decisions while a node was not EXACT")
    overcounted_resyncing: int = Field(description="Of those, assuming a block not there")
    decisions_stale_exact: int = Field(description="Decisions while EXACT but not caught up")
    overcounted_stale_exact: int = Field(description="Of those, assuming a block not there")
    decisions_after_resync: int = Field(description="Decisions after the index caught up")
    overcounted_after_resync: int = Field(description="Of those, assuming a block not there")
    naive_overcounted: int = Field(description="The naive index's overcounted decisions")
    assumed_blocks: int = Field(description="Blocks the decisions assumed")
    unservable_exact: int = Field(description="Decisions assuming a block the master can't serve")
    blocks_held: int = Field(description="Blocks the master lists at the end")
    ssd_only_blocks_indexed: int = Field(description="Listed blocks the index has on SSD")


class DropFault(IndexFault):
    dropped_messages: int = Field(description="KV event messages dropped")


class NodeKillFault(IndexFault):
    silent_detect_s: float | None = Field(
        description="Kill until the node counts as unsure (s); null if not within 4 s"
    )


class IndexFaults(BenchModel):
    drop: DropFault = Field(description="Lost KV events (drop_p of messages)")
    master_restart: IndexFault = Field(description="Store master SIGKILLed and restarted")
    node_kill: NodeKillFault = Field(description="A store node SIGKILLed, restarted after 4 s")


class FollowerStats(BenchModel):
    """`KvIndexFollower.stats`."""

    applied: int = Field(description="Event batches applied")
    duplicates: int = Field(description="Batches seen twice")
    gaps: int = Field(description="Sequence gaps found")
    snapshots: int = Field(description="Snapshots applied")
    buffer_dropped: int = Field(description="Batches dropped from the reorder buffer")


class IndexResult(BenchModel):
    """`mooncake bench index`: the Conductor's KV index under faults."""

    nodes: int = Field(description="Store nodes")
    prompts: int = Field(description="Prompts of the workload")
    block_bytes: int = Field(description="Bytes per block")
    drop_p: float = Field(description="Share of KV event messages dropped in the drop fault")
    fault_s: float = Field(description="Seconds of workload per phase")
    decisions_per_poll: int = Field(description="Decisions checked every 50 ms after a fault")
    faults: IndexFaults = Field(description="Figures per fault")
    workload_ops: int = Field(description="Store ops the workload made")
    workload_errors: int = Field(description="Store ops that failed")
    snapshots: int = Field(description="KV snapshots the subscriber requested")
    follower: FollowerStats = Field(description="The follower's counters")
    resync_s_max: float = Field(description="Largest resync_s over the faults (s)")
    decisions_after_resync: int = Field(description="Sum over the faults")
    overcounted_decisions_after_resync: int = Field(description="Sum over the faults (target 0)")
    overcounted_decisions_stale_exact: int = Field(description="Sum over the faults")
    overcounted_decisions_while_resyncing: int = Field(description="Sum over the faults")
    naive_overcounted_decisions: int = Field(description="The naive index's, sum over the faults")


# --- pipeline -------------------------------------------------------------------------------------


class PipelineResult(BenchModel):
    """`mooncake bench pipeline`: time outside the model vs a bare 3-hop relay; admission rate."""

    requests: int = Field(description="Requests with a first token and a prefilled event")
    overhead_p50_ms: float = Field(description="Submit->first token minus prefill compute, p50")
    overhead_p99_ms: float = Field(description="The same, p99 (ms)")
    compute_p50_ms: float = Field(description="The worker's prefill_s, p50 (ms)")
    raw_nats_p50_ms: float = Field(description="Bare nats-py 3-hop JetStream relay p50 (ms)")
    raw_nats_p99_ms: float = Field(description="The same, p99 (ms)")
    overhead_ratio: float = Field(description="overhead p50 / raw relay p50")
    burst: int = Field(description="Submissions published at once")
    admitted: int = Field(description="Of the burst, admitted")
    admitted_req_s: float = Field(description="Sustained admission decisions (req/s)")
    cpus: int | None = Field(description="os.cpu_count()")


# --- overload -------------------------------------------------------------------------------------

# The SLO percentile in a key's name (`ttft_p90_s` at --percentile 0.9).
_PCT = r"p\d+"


class CapacityTry(PatternKeysModel):
    """One closed-loop try at a client count."""

    PATTERN_KEYS = {
        rf"ttft_{_PCT}_s": (float | None, "TTFT at the SLO percentile (s; null: a miss)"),
        rf"tbt_{_PCT}_s": (float | None, "TBT at the SLO percentile (s; null: a miss)"),
    }
    clients: int = Field(description="Closed-loop clients")
    completed_req_s: float = Field(description="Completed requests/s over the window")
    within_slo: bool = Field(description="The SLO held at the percentile")


class OverloadProfile(BenchModel):
    """The cost profile calibrated in the run."""

    prefill_samples: int = Field(description="Prefill service times measured")
    prefill_service_p50_s: float | None = Field(description="Their p50 (s)")
    prefill_service_p90_s: float | None = Field(description="Their p90 (s)")
    prefill_queue_bound: int = Field(description="Prefill queue admission allows (requests)")


class StageTimes(BenchModel):
    """Where the admitted requests' TTFT went (s)."""

    admission: P50P90 = Field(description="Submission -> admission")
    queue: P50P90 = Field(description="Admission -> prefill start")
    prefill: P50P90 = Field(description="Prefill start -> prefilled")


class PhaseChecks(BenchModel):
    slo_met_at_percentile: bool = Field(description="Admitted requests met the SLO")
    every_request_one_terminal: bool = Field(description="Exactly one terminal event each")
    nothing_admitted_dropped: bool = Field(description="Every admitted request ended properly")
    rejections_have_reasons: bool = Field(description="Every rejection has a known reason")


class OverloadPhase(PatternKeysModel):
    """One offered load: `phase_figures`, the rates and `Watch.summary`."""

    PATTERN_KEYS = {
        rf"ttft_{_PCT}_s": (float | None, "Admitted TTFT at the SLO percentile (s)"),
        rf"tbt_{_PCT}_s": (float | None, "Admitted TBT at the SLO percentile (s)"),
        rf"client_ttft_{_PCT}_s": (float | None, "Client-seen TTFT at the percentile (s)"),
    }
    factor: float = Field(description="Offered load as a multiple of capacity")
    offered_req_s: float = Field(description="Arrivals / phase_s (req/s)")
    requests: int = Field(description="Requests sent")
    admitted: int = Field(description="With a request.admitted in the record")
    rejected: int = Field(description="Ended by exactly one request.rejected")
    rejected_by_reason: ReasonCounts = Field(description="Rejections by reason code")
    ended_as: ReasonCounts = Field(description="Requests with one terminal, by its kind")
    ttft_p50_s: float | None = Field(description="Admitted TTFT p50 (s; null: misses)")
    tbt_p50_s: float | None = Field(description="Admitted TBT p50 (s)")
    slo_attainment: float | None = Field(description="Admitted within SLO / admitted")
    ttft_parts_s: StageTimes = Field(description="TTFT by stage")
    not_one_terminal: list[str] = Field(description="Request ids without exactly one (first 10)")
    admitted_not_ended: list[str] = Field(description="Admitted ids badly ended (first 10)")
    client_unfinished: list[str] = Field(description="Admitted ids unfinished at the client")
    checks: PhaseChecks = Field(description="The phase's checks")
    admitted_req_s: float = Field(description="Admitted / phase_s (req/s)")
    wall_s: float = Field(description="Phase wall time, drain included (s)")
    rss_max_mib: dict[str, float] = Field(description="Largest RSS per process (MiB)")
    rss_growth_mib: dict[str, float] = Field(description="Last minus first RSS per process")
    cpu_s: dict[str, float] = Field(description="CPU seconds per process in the phase")
    conductor_backlog_max: int = Field(description="Largest Conductor JetStream backlog")
    prefill_queued_max: dict[str, int] = Field(description="Largest queue per prefill instance")
    decode_queued_max: dict[str, int] = Field(description="Largest queue per decode instance")
    decode_batch_max: dict[str, int] = Field(description="Largest batch per decode instance")


class Bounded(BenchModel):
    """No queue or process grows with the offered load."""

    prefill_queue_bounded: bool = Field(description="Prefill queues within the admission bound")
    conductor_backlog_bounded: bool = Field(description="Backlog within 2 s of arrivals")
    rss_within_budget: bool = Field(description="Every process within its RSS budget")
    rss_flat_at_equal_load: bool | None = Field(
        None, description="Only when the last two factors are equal: RSS flat between them"
    )


class OverloadResult(BenchModel):
    """`mooncake bench overload`: the trace at multiples of the measured capacity."""

    engine: str = Field(description="The model every worker runs")
    prefill_instances: int = Field(description="Prefill workers")
    decode_instances: int = Field(description="Decode workers")
    policy: str = Field(description="The rejecting admission policy")
    slo: SloAtPercentile = Field(description="The SLO admitted requests are held to")
    admission_limit: Slo = Field(description="What the Conductor admits against (admit_at x SLO)")
    capacity_req_s: float = Field(description="Capacity: completed req/s within the SLO")
    capacity_clients: int = Field(description="Client count of that capacity")
    capacity_tries: list[CapacityTry] = Field(description="Every closed-loop try")
    profile: OverloadProfile = Field(description="The calibrated cost profile")
    phases: list[OverloadPhase] = Field(description="One per factor")
    bounded: Bounded = Field(description="Growth checks over the phases")
    workers_alive: bool = Field(description="No worker dead at the end")
    wall_s: float = Field(description="Whole run (s)")
    cpus: int | None = Field(description="os.cpu_count()")


# --- conductor ------------------------------------------------------------------------------------


class ConductorResult(BenchModel):
    """`mooncake bench conductor`: decisions/s and latency vs no prefix index."""

    policy: str = Field(description="Admission policy of the loop")
    prefill_instances: int = Field(description="Prefill instances")
    decode_instances: int = Field(description="Decode instances")
    indexed_blocks: int = Field(description="Keys in the global block index")
    index_build_s: float = Field(description="Building the index (s)")
    requests: int = Field(description="Decisions timed")
    inflight: int = Field(description="Requests kept in flight")
    decisions_per_s: float = Field(description="Decisions over the loop's wall time (/s)")
    p50_us: float = Field(description="`decide` alone, p50 (us)")
    p99_us: float = Field(description="`decide` alone, p99 (us)")
    admitted: int = Field(description="Requests admitted")
    took_remote_prefix: int = Field(description="Admitted ones fetching a remote prefix")
    baseline: str = Field(description="What the baseline is")
    baseline_decisions_per_s: float = Field(description="Baseline decisions/s")
    baseline_p99_us: float = Field(description="Baseline p99 (us)")
    ratio: float = Field(description="decisions_per_s / baseline_decisions_per_s")
    target_decisions_per_s: int = Field(description="The target (decisions/s)")


# --- engine ---------------------------------------------------------------------------------------


class LlamacppStatus(BenchModel):
    error: str | None = Field(
        description="Null where the llamacpp_* fields are there, else why not"
    )


class EngineResult(BenchModel):
    """`mooncake bench engine`: prefill/decode speed vs transformers (and llama.cpp)."""

    model: str = Field(description="Model name")
    device: str = Field(description="torch device (with the GPU's name on CUDA)")
    weights: str = Field(description="'quantized' or the weights' dtype")
    weights_mb: float = Field(description="Weight bytes (MiB)")
    decode_path: Literal["fused", "graphs", "eager"] = Field(description="How decode steps run")
    prefill_attention: str = Field(description="How prefill attention runs")
    prefill_gemm: str = Field(description="How prefill GEMMs multiply")
    bf16_gemm_speedup: float | None = Field(description="bfloat16 GEMM over float32 (null: none)")
    bf16_attention_speedup: float | None = Field(description="bfloat16 attention over float32")
    torch_threads: int = Field(description="torch threads")
    reps: int = Field(description="Timed repetitions (medians)")
    # _bench_prefill
    prefill_tokens: int = Field(description="Prompt tokens of the prefill run")
    prefill_tok_s: float = Field(description="Engine prefill (tok/s)")
    ref_prefill_tok_s: float = Field(description="transformers prefill (tok/s)")
    prefill_ratio: float = Field(description="Engine over reference, paired median")
    prefill_tok_s_mapped: float = Field(description="Prefill, temporaries mapped one by one")
    compute_heap_speedup: float = Field(description="Heap temporaries over mapped, paired")
    ref_argmax_agreement: float = Field(description="Share of positions with the same argmax")
    ref_logits_max_abs_diff: float = Field(description="Largest logit difference vs reference")
    # _bench_decode
    decode_tokens: int = Field(description="Tokens per decode run")
    decode_prompt_tokens: int = Field(description="Prompt tokens before each decode run")
    decode_tok_s_b1: float = Field(description="Engine greedy decode, batch 1 (tok/s)")
    ref_decode_tok_s_b1: float = Field(description="Reference decode, batch 1 (tok/s)")
    decode_ratio: float = Field(description="Engine over reference, batch 1")
    decode_tok_s_b8: float = Field(description="Engine decode, batch 8, summed (tok/s)")
    decode_b8_over_b1: float = Field(description="Batch 8 over batch 1, paired (target >= 4)")
    # _bench_prefix
    prefix_cold_s: float = Field(description="2,048-token prefill, nothing cached (s)")
    prefix_hit_s: float = Field(description="The same with 1,792 tokens cached (s)")
    prefix_hit_speedup: float = Field(description="Cold over cached, paired")
    prefix_gemm_ratio: float = Field(description="Cold GEMMs over cached GEMMs")
    prefix_attention_ratio: float = Field(description="Cold attention over cached")
    prefix_hit_ceiling: float = Field(description="prefix_hit_speedup of GEMMs + attention alone")
    # _bench_eager: decode_path fused or graphs
    eager_decode_tok_s_b1: float | None = Field(
        None, description="Unless decode_path is eager: op-by-op decode, batch 1 (tok/s)"
    )
    eager_decode_tok_s_b8: float | None = Field(
        None, description="Unless decode_path is eager: op-by-op decode, batch 8 (tok/s)"
    )
    fused_over_eager_b1: float | None = Field(None, description="decode_path fused: b1 ratio")
    fused_over_eager_b8: float | None = Field(None, description="decode_path fused: b8 ratio")
    graphs_over_eager_b1: float | None = Field(None, description="decode_path graphs: b1 ratio")
    graphs_over_eager_b8: float | None = Field(None, description="decode_path graphs: b8 ratio")
    # _bench_float32: quantized weights
    logits_max_abs_diff: float | None = Field(
        None, description="Quantized weights only: largest logit diff vs float32 weights"
    )
    float32_decode_tok_s_b1: float | None = Field(
        None, description="Quantized only: float32-weights engine decode, batch 1 (tok/s)"
    )
    decode_b1_over_float32: float | None = Field(None, description="Quantized only: b1 ratio")
    float32_weights_mb: float | None = Field(None, description="Quantized only: float32 (MiB)")
    # CUDA only
    copy_gb_s: float | None = Field(None, description="CUDA only: device copy bandwidth (GB/s)")
    bandwidth_limit_tok_s_b1: float | None = Field(
        None, description="CUDA only: bandwidth / weight bytes (tok/s)"
    )
    decode_b1_of_bandwidth_limit: float | None = Field(
        None, description="CUDA only: decode_tok_s_b1 over that limit"
    )
    # CPU with the GGUF (no --shape): llamacpp always, the rest where it gave figures
    llamacpp: LlamacppStatus | None = Field(
        None, description="CPU, GGUF model only: whether the llama.cpp anchor ran"
    )
    llamacpp_prefill_tok_s: float | None = Field(None, description="llama.cpp prefill (tok/s)")
    llamacpp_prefill_ratio: float | None = Field(None, description="Ours over llama.cpp's")
    llamacpp_decode_prompt_tokens: int | None = Field(
        None, description="Prompt before the llama.cpp decode runs"
    )
    decode_tok_s_b1_after_512: float | None = Field(
        None, description="Engine decode after that prompt, batch 1 (tok/s)"
    )
    llamacpp_decode_tok_s_b1: float | None = Field(None, description="llama.cpp decode (tok/s)")
    llamacpp_decode_ratio: float | None = Field(None, description="Ours over llama.cpp's")
    b8_over_llamacpp_b1: float | None = Field(None, description="Our batch 8 over their batch 1")
    torch: str = Field(description="torch version")
    busy_at_start: list[str] = Field(description="Other processes using the CPUs at start")


# --- memory ---------------------------------------------------------------------------------------


class TbtLimitCounts(BenchModel):
    """Completed within the TTFT SLO and each of the paper's TBT limits (PAPER.md §7)."""

    tbt_0_1: int = Field(alias="0.1", description="TBT <= 0.1 s")
    tbt_0_2: int = Field(alias="0.2", description="TBT <= 0.2 s")
    tbt_0_3: int = Field(alias="0.3", description="TBT <= 0.3 s")


class P50P90Count(P50P90):
    n: int = Field(description="Samples")


class RequestFigures(BenchModel):
    """`memory.request_figures`: how the replayed requests ended, from the record."""

    requests: int = Field(description="Requests replayed")
    completed: int = Field(description="Last terminal: completed")
    rejected: int = Field(description="Last terminal: rejected")
    failed: int = Field(description="Last terminal: failed")
    cancelled: int = Field(description="Last terminal: cancelled")
    unended: int = Field(description="No terminal event")
    rejected_by_reason: ReasonCounts = Field(description="Rejections by reason")
    failed_by_reason: ReasonCounts = Field(description="Failures by reason")
    rejections_have_reasons: bool = Field(description="Every rejection has a known reason")
    terminal_exactly_once: bool = Field(description="Every request one terminal event")
    terminal_violations: list[str] = Field(description="Ids without exactly one (first 10)")
    preemptions: int = Field(description="request.decode_preempted events")
    preempted_requests: int = Field(description="Requests preempted at least once")
    wall_s: float = Field(description="Replay wall time (the timeout if it timed out) (s)")
    throughput_req_s: float = Field(description="Completed / wall_s")
    goodput_req_s: float = Field(description="Completed within the SLO / wall_s")
    within_slo: int = Field(description="Completed within the SLO")
    within_ttft_slo: int = Field(description="Completed within the TTFT SLO")
    within_slo_by_tbt_limit_s: TbtLimitCounts = Field(description="Per paper TBT limit")
    slo: Slo = Field(description="settings.slo")
    ttft_s: P50P90 = Field(description="Completed requests' TTFT (s)")
    tbt_s: P50P90 = Field(description="Completed requests' TBT (s)")
    ttft_over_predicted: P50P90Count = Field(
        description="TTFT over the Conductor's prediction at admission (1 = exact)"
    )


class WorkerExit(BenchModel):
    name: str = Field(description="Role instance, e.g. decode-1")
    returncode: int | None = Field(description="Its return code (-9: SIGKILL)")
    at_s: float = Field(description="Seconds after the watch started")


class OomFigures(BenchModel):
    oom_kills: int = Field(description="Larger of the two counts below")
    oom_kills_source: Literal["cgroup memory.events", "worker returncode"] = Field(
        description="Which count oom_kills is"
    )
    oom_kills_by_returncode: int = Field(description="Workers that died by SIGKILL")
    oom_kills_by_cgroup: int | None = Field(description="cgroup v2 oom_kill delta (null: unread)")


class RoleMemory(BenchModel):
    """One role instance's peak memory and bounds (MiB): an engine role's, a control-plane
    role's (the bound it states at start, mooncake.memory.control_parts); null for others."""

    peak_rss_mb: float = Field(description="Peak RSS (MiB)")
    bound_mb: float | None = Field(
        description="Engine: weights + KV budget + 600 MiB; control plane: its stated bound"
    )
    stated_bound_mb: float | None = Field(
        description="Engine: that plus its store segment; control plane: its stated bound"
    )
    peak_anon_mb: float | None = Field(None, description="Where sampled: peak RssAnon (MiB)")
    peak_file_mb: float | None = Field(None, description="Where sampled: peak RssFile (MiB)")
    peak_shmem_mb: float | None = Field(None, description="Where sampled: peak RssShmem (MiB)")
    peak_pss_mb: float | None = Field(None, description="Where sampled: peak PSS (MiB)")
    peak_private_mb: float | None = Field(
        None,
        description="Where sampled: peak RssAnon + RssFile in one sample, the worker alone"
        " (peak_rss_mb counts its children too) (MiB)",
    )


class InfraMemory(BenchModel):
    peak_rss_mb: float = Field(description="Peak RSS with children (MiB)")


class FitSummary(BenchModel):
    """`trace_fit.Fitted.summary`: what fitting the trace to the context did."""

    mode: str = Field(description="scale | truncate | skip")
    context_tokens: int = Field(description="The model's context")
    changed: int = Field(description="Requests scaled or truncated")
    skipped: int = Field(description="Requests skipped")


class DecodeRatio(BenchModel):
    """`contiguous.decode_ratio` and its `RatioOptions`."""

    paged_tok_s: float = Field(description="Paged pool decode (tok/s)")
    contiguous_tok_s: float = Field(description="Old contiguous layout decode (tok/s)")
    ratio: float = Field(description="Paged over contiguous, paired median")
    prompts: int = Field(description="Sequences (the batch)")
    prompt_tokens: int = Field(description="Tokens per prompt")
    steps: int = Field(description="Timed steps")
    reps: int = Field(description="Paired repetitions")
    threads: int = Field(description="torch threads")


class MemoryChecks(BenchModel):
    no_failed: bool = Field(description="No request failed")
    no_oom_kills: bool = Field(description="oom_kills == 0")
    within_bounds_private: bool = Field(
        description="Every role's peak private RSS (the shared store segments left out) within"
        " bound_mb"
    )
    within_stated_bounds_pss: bool = Field(description="Peak PSS within the stated bounds")
    goodput_positive: bool = Field(description="goodput_req_s > 0")
    terminal_exactly_once: bool = Field(description="One terminal event per request")
    rejections_have_reasons: bool = Field(description="Every rejection has a known reason")


class MemoryResult(RequestFigures, OomFigures):
    """`mooncake bench memory`: the whole stack under a trace, each role's memory bound."""

    model: str = Field(description="settings.engine.model")
    kv_budget_bytes: int = Field(description="Each engine worker's KV budget (bytes)")
    speed: float = Field(description="Arrival speed over the trace's")
    trace: str = Field(description="Trace file name")
    max_output_tokens: int = Field(description="Cap on output tokens per request")
    admission_policy: str = Field(description="The Conductor's policy")
    cost_profile: str | None = Field(description="The Conductor's cost profile path")
    replay_timed_out: bool = Field(description="The replay ran past the timeout")
    rss_samples: int = Field(description="RSS samples taken")
    worker_exits: list[WorkerExit] = Field(description="Worker exits found (and restarted)")
    fitted: FitSummary = Field(description="Fitting the trace to the model's context")
    took_s: float = Field(description="Whole run (s)")
    roles: dict[str, RoleMemory] = Field(description="Per worker instance")
    infrastructure: dict[str, InfraMemory] = Field(description="nats-server, postgres")
    within_bounds: bool = Field(description="Every role's peak RSS within bound_mb")
    within_bounds_private: bool = Field(
        description="Every role's peak RssAnon + RssFile within bound_mb"
    )
    within_bounds_pss: bool = Field(description="Every role's peak PSS within bound_mb")
    within_stated_bounds_pss: bool = Field(description="Peak PSS within stated_bound_mb")
    store_segment_mb: float = Field(description="Each engine worker's store segment (MiB)")
    weights_mb: float = Field(description="Model weights (MiB)")
    paged_vs_contiguous_decode_b32: float | None = Field(
        description="decode_b32.ratio; null with --skip-decode-ratio"
    )
    decode_b32: DecodeRatio | None = Field(description="Null with --skip-decode-ratio")
    checks: MemoryChecks = Field(description="The run's checks")
    checks_passed: bool = Field(description="All checks passed")
    logs: str | None = Field(None, description="Only when a check failed: the kept logs' dir")


# --- isolation ------------------------------------------------------------------------------------


class KindTtft(BenchModel):
    """Median client TTFT per kind of request (s)."""

    a_cold: float = Field(description="Tenant A, nothing cached")
    cross: float = Field(description="Tenant B, A's prompt")
    a_warm: float = Field(description="Tenant A again")
    shared_first: float = Field(description="Tenant C, shared namespace")
    shared_second: float = Field(description="Tenant D, the same shared namespace")


class FloodChecks(BenchModel):
    goodput_ratio_ok: bool = Field(
        alias="others_goodput_ratio >= 0.9", description="Calm tenants keep 90 % of goodput"
    )
    quota_rejections: bool = Field(
        alias="the flood's rejections carry tenant_quota", description="Shares bound the flood"
    )


class IsolationChecks(BenchModel):
    no_cross_hits: bool = Field(
        alias="cross_tenant_cached_tokens == 0", description="B reused none of A's blocks"
    )
    cross_cold: bool = Field(
        alias="cross-tenant TTFT cold-level", description="B's TTFT nearer A's cold than warm"
    )
    own_hits: bool = Field(
        alias="the same tenant hits its own blocks", description="A's repeat hit"
    )
    shared_hits: bool = Field(alias="a shared namespace hits", description="D hit C's blocks")
    shared_apart: bool = Field(
        alias="a shared namespace starts apart from the tenants'", description="C hit nothing"
    )
    goodput_ratio_ok: bool | None = Field(
        None, alias="others_goodput_ratio >= 0.9", description="With the flood: FloodChecks'"
    )
    quota_rejections: bool | None = Field(
        None,
        alias="the flood's rejections carry tenant_quota",
        description="With the flood: FloodChecks'",
    )


class Flood(BenchModel):
    """Two calm tenants alone, then beside a flooding third."""

    calm_rate_per_s: float = Field(description="Each calm tenant's rate (req/s)")
    calm_requests: int = Field(description="Calm requests of the alone phase")
    calm_goodput_alone: int = Field(description="Calm requests within the SLO, alone")
    calm_goodput_beside_flood: int = Field(description="The same beside the flood")
    others_goodput_ratio: float | None = Field(description="Beside over alone (null: none alone)")
    flood_requests: int = Field(description="The flood's requests")
    flood_goodput: int = Field(description="Of those, within the SLO")
    flood_rejections: ReasonCounts = Field(description="The flood's rejections by reason")
    checks: FloodChecks = Field(description="The flood's checks")
    lone_ttft_s: float = Field(description="A lone flood-shaped request's TTFT (s)")
    prefill_instances: int = Field(description="Prefill workers")
    flood_rate_per_s: float = Field(description="The flood's rate (req/s)")


class IsolationResult(BenchModel):
    """`mooncake bench isolation`: tenants and the shared KV pool."""

    requests_per_kind: int = Field(description="Prompts (each sent once per kind)")
    cross_tenant_cached_tokens: int = Field(description="Tokens B reused of A's (must be 0)")
    same_tenant_cached_tokens: int = Field(description="Tokens A's repeat reused")
    shared_cached_tokens: int = Field(description="Tokens D reused in the shared namespace")
    shared_first_cached_tokens: int = Field(description="Tokens C reused (must be 0)")
    cold_cached_tokens: int = Field(description="Tokens A's first send reused")
    ttft_median_s: KindTtft = Field(description="Median TTFT per kind")
    cross_over_cold_ttft: float | None = Field(description="cross / a_cold TTFT")
    warm_over_cold_ttft: float | None = Field(description="a_warm / a_cold TTFT")
    checks: IsolationChecks = Field(description="The checks, the flood's too where it ran")
    checks_passed: bool = Field(description="All checks passed")
    others_goodput_ratio: float | None = Field(description="flood.others_goodput_ratio; null: none")
    flood: Flood | None = Field(None, description="Only with --flood (the default)")
    prompt_tokens: int = Field(description="Tokens per prompt")
    block_tokens: int = Field(description="Tokens per KV block")
    took_s: float = Field(description="Whole run (s)")
    logs: str | None = Field(None, description="Only when a check failed: the kept logs' dir")


# --- cpp ------------------------------------------------------------------------------------------

_N = r"\d+"  # a group's size (stages) in a key's name


class CppResult(PatternKeysModel):
    """`mooncake bench cpp`: one worker's prefill vs groups of stage workers."""

    PATTERN_KEYS = {
        rf"ttft_{_N}_s": (float, "A group of N stages: prefill time, median (s)"),
        rf"speedup_{_N}": (float, "ttft_1_s over the group's, median of per-rep ratios"),
        rf"speedup_{_N}_each": (list[float], "With reps > 1: each repetition's speedup"),
        rf"argmax_same_{_N}": (bool, "The last position's argmax as the single worker's"),
        rf"stage_busy_{_N}_s": (list[float], "Each stage's busy seconds, first repetition"),
    }
    model: str = Field(description="settings.engine.model")
    prompt_tokens: int = Field(description="Tokens of the prompt")
    chunk_tokens: int = Field(description="Tokens of each chunk (nominal)")
    balanced_chunks: bool = Field(description="Chunks of about equal FLOPs")
    chunks: list[int] = Field(description="Chunk lengths of the 2-stage plan (tokens)")
    threads_per_worker: int = Field(description="torch threads per worker")
    reps: int = Field(description="Repetitions of every run")
    pinned: list[int] = Field(description="Group sizes whose workers were pinned (1: single)")
    transport: str = Field(description="Activations between stages: shm | tcp")
    layers: int = Field(description="Model layers")
    ttft_1_s: float = Field(description="The single worker's prefill, median (s)")
    logits_max_abs_diff: float | None = Field(description="Largest logit diff, pipeline vs one")
    cpu_count: int = Field(description="multiprocessing.cpu_count()")
    parallel_2: float = Field(description="Two workers side by side over one alone (2.0 ideal)")
    speedup_2_of_parallel_2: float | None = Field(
        None, description="Only with a group of 2: speedup_2 / parallel_2"
    )
    busy_at_start: list[str] = Field(description="Other processes using the CPUs at start")


class CppLiveResult(BenchModel):
    """`mooncake bench cpp --live`: the long prompt through a running stack, groups off/on."""

    model: str = Field(description="settings.engine.model")
    prompt_tokens: int = Field(description="Tokens of the prompt")
    chunk_tokens: int = Field(description="cpp.chunk_tokens")
    min_efficiency: float = Field(description="cpp.min_efficiency")
    threads_per_worker: int = Field(description="torch threads per worker")
    cpu_count: int | None = Field(description="os.cpu_count()")
    cpu_1_s: dict[str, float] = Field(description="Groups off: CPU s per process during the ask")
    live_ttft_1_s: float = Field(description="Groups off: client TTFT (s)")
    live_prefill_1_s: float = Field(description="Groups off: the leader's prefill_s (s)")
    stages_1: list[str] = Field(description="Groups off: instances that prefilled it")
    cpp_fallback_1: str | None = Field(None, description="Only if set: why no group, groups off")
    cpu_2_s: dict[str, float] = Field(description="Groups of two: CPU s per process")
    live_ttft_2_s: float = Field(description="Groups of two: client TTFT (s)")
    live_prefill_2_s: float = Field(description="Groups of two: the leader's prefill_s (s)")
    stages_2: list[str] = Field(description="Groups of two: the group's instances (2)")
    cpp_fallback_2: str | None = Field(None, description="Only if set: why no group")
    live_speedup_2: float = Field(description="live_ttft_1_s / live_ttft_2_s")
    prefill_speedup_2: float = Field(description="live_prefill_1_s / live_prefill_2_s")
    same_answer: bool = Field(description="Both asks gave the same tokens")
    checks_passed: bool = Field(description="same_answer")
    took_s: float = Field(description="Whole run (s)")


# --- vs-vllm --------------------------------------------------------------------------------------


class LoneFigures(BenchModel):
    """`vs_vllm_figures.lone_figures`: a request alone on the server."""

    completed: bool = Field(description="It completed")
    error: str | None = Field(description="Rejection reason or error, else null")
    ttft_s: float | None = Field(description="Client TTFT (s)")
    decode_tok_s: float | None = Field(description="Decode after the first token (tok/s)")
    tokens: int = Field(description="Output tokens")


class RateRun(BenchModel):
    """One server at one speed: `vs_vllm_figures.run_figures`, with the speed."""

    speed: float = Field(description="Trace speed")
    rate_rps: float = Field(description="Requests/s it sends (may be Infinity)")
    requests: int = Field(description="Requests sent")
    completed: int = Field(description="Completed")
    good: int = Field(description="Completed within both SLOs")
    goodput_rps: float = Field(description="Good / run span (req/s)")
    rejected: int = Field(description="Refused with 429")
    rejected_by_reason: ReasonCounts = Field(description="Refusals by reason code")
    errors: ReasonCounts = Field(description="Other failures by kind")
    ttft_s: P50P90P99 = Field(description="Completed requests' TTFT (s)")
    tbt_s: P50P90P99 = Field(description="Gaps between tokens (s)")
    prompt_tok_s: float = Field(description="Completed prompt tokens / span (tok/s)")
    output_tokens: int = Field(description="Output tokens of the completed")
    span_s: float = Field(description="First send to last end (s)")
    peak_pss_mb: float | None = Field(description="Peak PSS during the run (MiB; null: none)")
    cpu_s: dict[str, float] | None = Field(
        None,
        description="CPU seconds the server's processes used meanwhile, by role (ours: the"
        " worker roles, nats-server, postgres; vLLM's: process names); null: not measured",
    )
    cpu_busy: float | None = Field(
        None, description="Their CPU seconds over the run's seconds x the CPUs (1: all busy)"
    )


class ServerFigures(BenchModel):
    lone: LoneFigures = Field(description="The lone request")
    runs: list[RateRun] = Field(description="The measured speeds, in order")
    searched: list[float] | None = Field(description="Speeds the peak search ran (null: none)")
    peak_pss_mb: float = Field(description="Peak PSS over the whole run (MiB)")


class ServerError(BenchModel):
    error: str = Field(description="Why the server has no figures ('not run', its failure)")


class VsVllmSlo(BenchModel):
    ttft_s: float = Field(description="TTFT limit (s)")
    tbt_p90_s: float = Field(description="Limit on a request's p90 gap between tokens (s)")


class VsVllmWorkload(BenchModel):
    block_tokens: int = Field(description="Tokens per trace hash id")
    max_prompt: int = Field(description="Prompt cut (tokens)")
    max_output: int = Field(description="Output cap (tokens)")
    trace: str = Field(description="Trace file name")


class VsVllmResult(BenchModel):
    """`mooncake bench vs-vllm`: goodput beside vLLM's server, same cores, prompts, SLOs."""

    # `summary`: only when both servers have runs
    goodput_ratio_min: float | None = Field(
        None, description="Both ran: lowest goodput ratio where vLLM's is > 0"
    )
    overload_goodput_positive: bool | None = Field(
        None, description="Both ran: our goodput > 0 wherever vLLM's is 0"
    )
    lowest_rate_rejected_frac: float | None = Field(
        None, description="Both ran: our rejected share at the lowest speed"
    )
    lone_ttft_ratio: float | None = Field(None, description="Both ran: lone TTFT, ours/theirs")
    lone_decode_ratio: float | None = Field(None, description="Both ran: lone decode tok/s ratio")
    pss_ratio: float | None = Field(None, description="Both ran: peak PSS, ours/theirs")
    tbt_p90_s_max: float | None = Field(None, description="Both ran: our largest TBT p90 (s)")
    engine: str = Field(description="Our engine")
    requests: int = Field(description="The trace's first requests sent")
    slo: VsVllmSlo = Field(description="The SLOs both are judged by")
    workload: VsVllmWorkload = Field(description="What defines the prompts")
    vllm: ServerFigures | ServerError = Field(description="vLLM's figures, or why none")
    mooncake: ServerFigures | ServerError = Field(description="Ours, or why none")


# --- the registry ---------------------------------------------------------------------------------

SCHEMAS: dict[str, type[BenchModel]] = {
    "bus": BusResult,
    "store": StoreResult,
    "index": IndexResult,
    "pipeline": PipelineResult,
    "overload": OverloadResult,
    "conductor": ConductorResult,
    "engine": EngineResult,
    "memory": MemoryResult,
    "isolation": IsolationResult,
    "cpp": CppResult,
    "cpp --live": CppLiveResult,
    "vs-vllm": VsVllmResult,
}

_SHOWN_ERRORS = 5


class BenchSchemaError(ValueError):
    """A bench's result does not match its schema (or the bench has none)."""


def _model(name: str) -> type[BenchModel]:
    try:
        return SCHEMAS[name]
    except KeyError:
        raise BenchSchemaError(
            f"no schema for bench {name!r} (known: {', '.join(SCHEMAS)})"
        ) from None


def validate(name: str, result: dict[str, Any]) -> BenchModel:
    """`result` as bench `name`'s model; BenchSchemaError naming the first mismatches."""
    model = _model(name)
    try:
        return model.model_validate(result)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        shown = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
            for e in errors[:_SHOWN_ERRORS]
        )
        more = f" (+{len(errors) - _SHOWN_ERRORS} more)" if len(errors) > _SHOWN_ERRORS else ""
        raise BenchSchemaError(
            f"bench {name}: result does not match its schema: {shown}{more}"
        ) from exc


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of bench `name`'s output."""
    return _model(name).model_json_schema()
