"""Every Prometheus metric the project exports, in one place (dashboards are checked
against this registry)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

BUS_HANDLED = Counter(
    "mc_bus_messages_total",
    "Messages handled by a consumer, by outcome (ack, retry, dead_letter)",
    ["consumer", "outcome"],
)
BUS_HANDLE_SECONDS = Histogram(
    "mc_bus_handle_seconds",
    "Time a consumer spent handling one batch",
    ["consumer"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
BUS_PUBLISHED = Counter(
    "mc_bus_published_total", "Events published to JetStream, by event type", ["type"]
)
BUS_PUBLISH_RETRIES = Counter(
    "mc_bus_publish_retries_total", "Publishes retried after a timeout or disconnect", ["type"]
)
DEAD_LETTERS = Counter(
    "mc_dead_letters_total",
    "Messages dead-lettered, by consumer and reason",
    ["consumer", "reason"],
)
RECORDER_EVENTS = Counter(
    "mc_recorder_events_total",
    "Events the recorder saw, by result (inserted, duplicate)",
    ["result"],
)
RECORDER_ILLEGAL = Counter(
    "mc_recorder_illegal_transitions_total",
    "Lifecycle events that were recorded but not applied to the requests projection",
)
RECORDER_LAG_SECONDS = Gauge(
    "mc_recorder_lag_seconds", "Age of the newest event in the last committed recorder batch"
)
RECORDER_BATCH_SECONDS = Histogram(
    "mc_recorder_batch_seconds",
    "Time to insert one batch and update projections in one transaction",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
REQUESTS_REJECTED = Counter(
    "mc_requests_rejected_total", "Requests rejected, by stage and reason", ["stage", "reason"]
)
REQUESTS_ADMITTED = Counter("mc_requests_admitted_total", "Requests admitted", ["policy"])

# --- requests: how they ended, and their latency against the SLO ------------------------------
# Bucket bounds include the default SLOs (config.SLO: TTFT 30 s, TBT 0.1 s) so that the
# fraction within the SLO is exact and histogram_quantile interpolates inside tight buckets
# around it; the configured SLO itself is exported (mc_slo_seconds) for dashboards and alerts.
REQUESTS_ENDED = Counter(
    "mc_requests_ended_total",
    "Terminal events a prefill or decode worker published (it won the request's terminal "
    "claim), by type (completed, failed, cancelled), stage and reason; the Conductor's own "
    "are mc_conductor_terminal_total, rejections mc_requests_rejected_total",
    ["type", "stage", "reason"],
)
TTFT_SECONDS = Histogram(
    "mc_request_ttft_seconds",
    "Time to first token of each completed request (submitted -> first token streamed)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 25, 30, 40, 60, 120, 300),
)
TBT_SECONDS = Histogram(
    "mc_request_tbt_seconds",
    "Time between tokens of each completed request: the mean of its slowest 10 % of "
    "inter-token gaps (how the SLO scores it)",
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
)
SLO_SECONDS = Gauge("mc_slo_seconds", "The configured service-level objective", ["slo"])
TOKEN_COPIES_NOT_STORED = Counter(
    "mc_token_copies_not_stored_total",
    "Requests whose replayable token copy (MC_TOKENS) missed tokens: the broker refused the "
    "final batch for longer than the streamer retries (each also a request.tokens_not_stored "
    "event in the record)",
)
TOKEN_READ_BACKS = Counter(
    "mc_token_read_backs_total",
    "Asks to the token read-back service (a client filling what it missed from a request's "
    "copy), by outcome: answered, refused (not the asker's request, or unreadable) or busy",
    ["outcome"],
)
TOKENS_GENERATED = Counter(
    "mc_tokens_generated_total",
    "Output tokens generated, by stage (prefill samples the first, decode the rest)",
    ["stage"],
)

# --- tenants (the recorder: each request counted once, when its terminal event is recorded) ---
# Tenant labels are capped (`TenantLabels`): tenant ids come from clients.
TENANT_REQUESTS_ENDED = Counter(
    "mc_tenant_requests_ended_total",
    "Requests that ended, by tenant and outcome (completed, failed, cancelled, rejected)",
    ["tenant", "outcome"],
)
TENANT_GOODPUT = Counter(
    "mc_tenant_goodput_total",
    "Requests completed within both SLOs (TTFT and TBT, the recorder's settings), by tenant: "
    "over mc_tenant_requests_ended_total, the tenant's goodput ratio",
    ["tenant"],
)
TENANT_PROMPT_TOKENS = Counter(
    "mc_tenant_prompt_tokens_total",
    "Prompt tokens of the ended requests that were prefilled, by tenant (the hit rate's "
    "denominator)",
    ["tenant"],
)
TENANT_CACHED_TOKENS = Counter(
    "mc_tenant_cached_tokens_total",
    "Of those prompt tokens, the ones whose KV a prefill loaded from the store (cached "
    "prefix), by tenant",
    ["tenant"],
)

# --- the Conductor's view of the instances (from their load reports) -------------------------
KV_INDEX_NODES = Gauge(
    "mc_kv_index_nodes",
    "Store nodes and engine tiers whose KV index the Conductor holds, by its state: exact, "
    "resyncing (a gap, awaiting a snapshot) or degraded (no snapshot could be had); the "
    "blocks of those not exact count as unknown, not as hits",
    ["state"],
)
INSTANCE_QUEUE_DEPTH = Gauge(
    "mc_instance_queue_depth",
    "Requests waiting on an instance, from its latest load report",
    ["instance", "role"],
)
INSTANCE_RUNNING = Gauge(
    "mc_instance_running",
    "Requests an instance is computing (decode: its batch), from its latest load report",
    ["instance", "role"],
)
INSTANCES_DECLARED_DEAD = Counter(
    "mc_instances_declared_dead_total",
    "Instances the Conductor declared dead after their load reports stopped",
    ["role"],
)
CPP_FALLBACKS = Counter(
    "mc_cpp_fallbacks_total",
    "Prefills whose CPP group was given up, so that the leader prefilled them alone",
)
CPP_STAGES = Counter(
    "mc_cpp_stages_total",
    "CPP stages a prefill instance served for a group another one led, by outcome",
    ["outcome"],
)
WORK_REDISPATCHED = Counter(
    "mc_work_redispatched_total",
    "Work of a dead instance dispatched again to a live one, by stage",
    ["stage"],
)
COST_MODEL_REFITS = Counter(
    "mc_conductor_cost_model_refits_total",
    "Refits of the Conductor's online cost model from reported timings, by stage",
    ["stage"],
)
COST_MODEL_ERROR = Gauge(
    "mc_conductor_cost_model_error_ratio",
    "Observed / predicted seconds of the latest timing the Conductor's cost model was fed "
    "(prefill: one request; decode: a report's mean step), by stage",
    ["stage"],
)
TTFT_MARGIN = Gauge(
    "mc_conductor_ttft_margin_ratio",
    "The factor rejecting admission policies judge predicted TTFT by: a quantile of "
    "observed / predicted TTFT of the latest requests (1 until there are enough)",
)
CONDUCTOR_INFLIGHT_SWEPT = Counter(
    "mc_conductor_inflight_swept_total",
    "Requests the Conductor's sweep took out of its view: ended, their end event never heard",
)
REQUESTS_ENDED_BY_CONDUCTOR = Counter(
    "mc_conductor_terminal_total",
    "Terminal events the Conductor published (failed after retries, cancelled), by type",
    ["type", "reason"],
)

# --- the prefill and decode workers (each about itself: one process, one scrape target) ------
WORKER_QUEUED = Gauge(
    "mc_worker_queued", "Requests waiting in this worker (as in its load reports)", ["stage"]
)
WORKER_RUNNING = Gauge(
    "mc_worker_running",
    "Requests this worker is computing (prefill: 0 or 1; decode: its batch)",
    ["stage"],
)
DECODE_CONTEXT_TOKENS = Gauge(
    "mc_decode_context_tokens", "KV tokens the running sequences of this decode worker hold"
)
DECODE_KV_CAPACITY_TOKENS = Gauge(
    "mc_decode_kv_capacity_tokens", "KV tokens this decode worker's KV pool holds"
)
DECODE_KV_FREE_TOKENS = Gauge(
    "mc_decode_kv_free_tokens",
    "KV tokens this decode worker's pool can hand out now (free pages and idle cached blocks)",
)
DECODE_PREEMPTIONS = Counter(
    "mc_decode_preemptions_total",
    "Sequences this decode worker took out of its batch for lack of KV pages (each resumes)",
)
DECODE_KV_RECOMPUTED = Counter(
    "mc_decode_kv_recomputed_total",
    "Decode work whose prompt KV was missing from the store and was recomputed locally",
    ["reason"],
)
# The cache hit rate per tier is mc_prefill_kv_tokens_total{tier} over its denominator
# mc_prefill_prompt_tokens_total; the tiers (computed included) add up to the denominator.
PREFILL_PROMPT_TOKENS = Counter(
    "mc_prefill_prompt_tokens_total", "Prompt tokens of the prefills this worker finished"
)
PREFILL_KV_TOKENS = Counter(
    "mc_prefill_kv_tokens_total",
    "Prompt tokens by where a prefill got their KV: shared from the engine's own KV pool "
    "(engine), loaded from this node's DRAM (local_dram), another node's DRAM (remote_dram), "
    "an SSD tier (ssd), or computed",
    ["tier"],
)

# --- the store ---------------------------------------------------------------------------------
STORE_OPS = Counter(
    "mc_store_ops_total",
    "Store client operations per object, by op (put, get, exists, remove) and result",
    ["op", "result"],
)
STORE_TRANSFER_BYTES = Counter(
    "mc_store_transfer_bytes_total",
    "Bytes moved by the store's transfer engine, by transport and direction (read, write)",
    ["transport", "direction"],
)
STORE_TRANSFER_SECONDS = Histogram(
    "mc_store_transfer_seconds",
    "Time of one batch transfer to or from one endpoint",
    ["transport", "direction"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
STORE_MOVES = Counter(
    "mc_store_moves_total",
    "Objects a node copied between its tiers (offload, promotion)",
    ["src_tier", "dst_tier"],
)
STORE_USED_BYTES = Gauge("mc_store_used_bytes", "Bytes allocated in the pool, by tier", ["tier"])
STORE_CAPACITY_BYTES = Gauge(
    "mc_store_capacity_bytes", "Bytes mounted in the pool, by tier", ["tier"]
)
STORE_OBJECTS = Gauge("mc_store_objects", "Objects known to the store master")
# Namespaces come from clients: labels capped like tenants' (`TenantLabels`).
STORE_NAMESPACE_BYTES = Gauge(
    "mc_store_namespace_bytes",
    "Store bytes charged to each cache namespace (what its quota caps), by tier",
    ["namespace", "tier"],
)
STORE_EVICTIONS = Counter(
    "mc_store_evictions_total", "Objects removed by the master, by reason", ["reason"]
)

# --- the gateway ---
GATEWAY_REQUESTS = Counter(
    "mc_gateway_requests_total",
    "HTTP requests the OpenAI-compatible gateway answered, by route and status code",
    ["route", "status"],
)
GATEWAY_REQUEST_SECONDS = Histogram(
    "mc_gateway_request_seconds",
    "Time from an HTTP request's arrival to the end of its response (a stream's last chunk)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
GATEWAY_IN_FLIGHT = Gauge(
    "mc_gateway_requests_in_flight", "HTTP requests the gateway is answering now", ["route"]
)
# The gateway's memory bound (gateway.max_inflight): completion requests, streamed or whole,
# holding a slot now, and the limit; past it a request is refused with 503 gateway_overloaded.
GATEWAY_COMPLETIONS_IN_FLIGHT = Gauge(
    "mc_gateway_completions_in_flight",
    "Completion requests the gateway is serving now (each holds one of gateway.max_inflight)",
)
GATEWAY_MAX_INFLIGHT = Gauge(
    "mc_gateway_max_inflight", "Completion requests the gateway serves at once at most"
)


OTHER_TENANTS = "_other"  # every tenant past the cap, together
UNKNOWN_TENANT = "_unknown"  # a request rejected before its submission was readable


class TenantLabels:
    """The `tenant` label of a tenant's metrics. Tenant ids come from clients (an OpenAI
    `user` digest): one series per id would let them grow the scrape without bound. The
    tenants named in the configuration and the first `limit` others seen get a label of
    their own; the rest share `_other`."""

    def __init__(self, named: Iterable[str], limit: int) -> None:
        self._named = frozenset(named)
        self._limit = limit
        self._seen: set[str] = set()

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return UNKNOWN_TENANT
        if tenant in self._named or tenant in self._seen:
            return tenant
        if len(self._seen) < self._limit:
            self._seen.add(tenant)
            return tenant
        return OTHER_TENANTS


class Scoped:
    """The registry's metric families whose names start with one of `prefixes`: what one
    process exports when every role's metrics share this module (the others' unlabeled
    counters would show as zero series of a role it does not play)."""

    def __init__(self, *prefixes: str) -> None:
        self.prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name.startswith(self.prefixes):
                yield family


# The gateway's own: its requests, what it publishes on the bus, the process.
GATEWAY_SCOPE = Scoped("mc_gateway_", "mc_bus_", "process_", "python_")
