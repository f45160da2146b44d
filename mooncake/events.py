"""The event envelope, every event type, and the one registry mapping type <-> subject.

Events are facts, named in the past tense, frozen, and validated once at ingress
(`parse_event`). Every event carries the envelope: `event_id` (also the JetStream
`Nats-Msg-Id`, so a retried publish is dropped by the server's dedupe window and by the
recorder's unique index), `type`, `occurred_at`, `schema_version` and the W3C
`traceparent` of the span that produced it. Request events add `request_id`.

Streams (`mooncake.namespace.STREAMS`): lifecycle facts live on `MC_REQ` (`mc.req.>`), metadata
facts (store objects, instances) on `MC_META` (`mc.meta.>`), dead letters on `MC_DLQ`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

# Re-exported: callers name them through this registry module (`ev.Namespace`, ...).
from mooncake.hashing import DEFAULT_TENANT
from mooncake.namespace import DEFAULT_NAMESPACE as DEFAULT_NAMESPACE
from mooncake.namespace import STREAMS as STREAMS
from mooncake.namespace import Namespace as Namespace
from mooncake.namespace import StreamSpec as StreamSpec

SCHEMA_VERSION = 1
ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
# NATS subject tokens may not contain '.', '*', '>' or whitespace.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
REPLY_SUBJECT_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"

Identifier = Annotated[str, Field(pattern=ID_PATTERN)]
SubjectToken = Annotated[str, Field(pattern=TOKEN_PATTERN)]


def new_event_id() -> str:
    return uuid.uuid4().hex


_DERIVED_NS = uuid.UUID("6d6f6f6e-6361-6b65-8000-000000000001")


def derived_event_id(parent_event_id: str, kind: str) -> str:
    """A deterministic id for the event a handler emits in response to another one.

    A redelivered message makes its handler publish the *same* event id again, so the
    broker's dedupe window and the recorder's unique index keep the effect exactly-once.
    """
    return uuid.uuid5(_DERIVED_NS, f"{parent_event_id}/{kind}").hex


def utcnow() -> datetime:
    return datetime.now(UTC)


class Event(BaseModel):
    """The envelope every event carries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    SUBJECT: ClassVar[str]

    event_id: Identifier = Field(default_factory=new_event_id)
    type: str
    occurred_at: datetime = Field(default_factory=utcnow)
    schema_version: Annotated[int, Field(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION
    traceparent: str | None = None

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


class RequestEvent(Event):
    request_id: Identifier


# --- request lifecycle -------------------------------------------------------------------


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    # A 64-bit seed, signed or not: what a torch generator takes (`manual_seed` overflows
    # past it, which would fail the request in its prefill, not reject it here).
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)
    ] = []
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = []


class RequestSubmitted(RequestEvent):
    """The public entry: a client publishes this on `mc.req.submitted`.

    `request_id` doubles as the idempotency key: a second submission with the same id is
    recorded but does not start a second request.
    """

    SUBJECT: ClassVar[str] = "mc.req.submitted"
    type: Literal["request.submitted"] = "request.submitted"

    prompt: Annotated[str, Field(min_length=1)] | None = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    params: SamplingParams = SamplingParams()
    slo_class: SubjectToken = "default"
    client_id: SubjectToken | None = None
    # Who the request is for: tenants never share cached KV blocks (`hashing.cache_salt`)
    # unless they opt into the same shared namespace: this request's `cache_namespace`, or
    # the one `Settings.shared_cache` names for its tenant.
    tenant: SubjectToken = DEFAULT_TENANT
    cache_namespace: SubjectToken | None = None
    # Core NATS subject the tokens and the outcome are streamed to: a literal subject (no
    # wildcards: a publish there would reach every matching listener). The Conductor also
    # refuses the system's own subjects (`ingress.reserved_reply_prefixes`).
    reply_to: Annotated[str, Field(max_length=256, pattern=REPLY_SUBJECT_PATTERN)] | None = None
    deadline_s: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> RequestSubmitted:
        if (self.prompt is None) == (self.token_ids is None):
            raise ValueError("exactly one of 'prompt' and 'token_ids' must be given")
        return self


class RejectReason(StrEnum):
    INVALID_REQUEST = "invalid_request"
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    PREFILL_OVERLOADED = "prefill_overloaded"
    DECODE_OVERLOADED = "decode_overloaded"
    NO_INSTANCE = "no_instance"
    # The client (`RequestSubmitted.client_id`) sent more than its per-client limit.
    CLIENT_RATE_LIMITED = "client_rate_limited"
    # The prompt, or the prompt and the max_tokens asked for, do not fit the model's context.
    PROMPT_TOO_LONG = "prompt_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    # Under contention its tenant holds more than its fair share of the work in flight
    # (core/tenancy.py): the others' requests go first.
    TENANT_QUOTA = "tenant_quota"
    # The Conductor already tracks `conductor.max_inflight` admitted requests: what bounds
    # its memory (a request in flight is state it keeps until the request ends).
    IN_FLIGHT_LIMIT = "in_flight_limit"


class RequestAdmitted(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.admitted"
    type: Literal["request.admitted"] = "request.admitted"

    policy: str
    prefill_instance: SubjectToken | None = None
    decode_instance: SubjectToken | None = None
    prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    cached_prefix_tokens: Annotated[int, Field(ge=0)] = 0
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    # Every input that drove the decision, so it can be explained afterwards.
    inputs: dict[str, Any] = {}


class RequestRejected(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.rejected"
    type: Literal["request.rejected"] = "request.rejected"

    reason: RejectReason
    stage: Literal["ingress", "admission", "prefill", "decode"] = "admission"
    detail: Annotated[str, Field(max_length=2000)] = ""
    policy: str | None = None
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    inputs: dict[str, Any] = {}


class PrefillStarted(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.prefill_started"
    type: Literal["request.prefill_started"] = "request.prefill_started"

    instance: SubjectToken
    attempt: Annotated[int, Field(ge=1)] = 1


class RequestPrefilled(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.prefilled"
    type: Literal["request.prefilled"] = "request.prefilled"

    instance: SubjectToken
    prompt_tokens: Annotated[int, Field(ge=0)]
    cached_tokens: Annotated[int, Field(ge=0)] = 0
    remote_cached_tokens: Annotated[int, Field(ge=0)] = 0
    kv_keys: list[str] = []
    first_token_id: Annotated[int, Field(ge=0)] | None = None
    prefill_s: Annotated[float, Field(ge=0)] = 0.0
    # A chunked-pipeline prefill (docs/cpp.md): the group that prefilled it, stage 0 first
    # (empty: one instance), and, where the Conductor chose a group that did not finish it,
    # why (`instance` then prefilled it alone).
    stages: Annotated[list[SubjectToken], Field(max_length=64)] = []
    cpp_fallback: Annotated[str, Field(max_length=1000)] | None = None


class DecodeStarted(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.decode_started"
    type: Literal["request.decode_started"] = "request.decode_started"

    instance: SubjectToken
    attempt: Annotated[int, Field(ge=1)] = 1


class DecodePreempted(RequestEvent):
    """A decode instance took the request out of its running batch because its KV pool ran
    out of pages. The request is not lost: the instance keeps its work and resumes it
    (`DecodeResumed`) once pages are free, reloading or recomputing the KV it gave back."""

    SUBJECT: ClassVar[str] = "mc.req.decode_preempted"
    type: Literal["request.decode_preempted"] = "request.decode_preempted"

    instance: SubjectToken
    attempt: Annotated[int, Field(ge=1)] = 1
    preemption: Annotated[int, Field(ge=1)] = 1  # the n-th preemption of this attempt
    output_tokens: Annotated[int, Field(ge=0)] = 0  # generated before it was taken out
    context_tokens: Annotated[int, Field(ge=0)] = 0  # KV tokens whose pages it gave back


class DecodeResumed(RequestEvent):
    """A preempted request is back in its instance's batch."""

    SUBJECT: ClassVar[str] = "mc.req.decode_resumed"
    type: Literal["request.decode_resumed"] = "request.decode_resumed"

    instance: SubjectToken
    attempt: Annotated[int, Field(ge=1)] = 1
    preemption: Annotated[int, Field(ge=1)] = 1
    # Where the KV it gave back came from: shared from the engine's pool or read from the
    # store (the prompt's blocks), or computed again (the tokens it had generated).
    reloaded_tokens: Annotated[int, Field(ge=0)] = 0
    recomputed_tokens: Annotated[int, Field(ge=0)] = 0
    waited_s: Annotated[float, Field(ge=0)] = 0.0


class DecodeStopped(RequestEvent):
    """A decode instance stopped a request it was streaming because the request was
    cancelled (by its client, its deadline, or the Conductor): how many output tokens the
    client had been sent. Whoever publishes the `request.cancelled` may not know that (the
    Conductor does not), so this fact may be recorded before or after it."""

    SUBJECT: ClassVar[str] = "mc.req.decode_stopped"
    type: Literal["request.decode_stopped"] = "request.decode_stopped"

    instance: SubjectToken
    attempt: Annotated[int, Field(ge=1)] = 1
    reason: Annotated[str, Field(min_length=1, max_length=64)]
    output_tokens: Annotated[int, Field(ge=0)]


class TokensNotStored(RequestEvent):
    """Some of a request's output tokens did not reach its replayable copy (MC_TOKENS): the
    broker refused them for longer than the streamer retries (`serving.streaming`). Its
    client got them live, unless its connection was down too; a read-back will not find
    indexes `first_index .. last_index`. Recorded after the request's terminal event."""

    SUBJECT: ClassVar[str] = "mc.req.tokens_not_stored"
    type: Literal["request.tokens_not_stored"] = "request.tokens_not_stored"

    instance: SubjectToken
    first_index: Annotated[int, Field(ge=0)]
    last_index: Annotated[int, Field(ge=0)]
    detail: Annotated[str, Field(max_length=2000)] = ""


class RequestCompleted(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.completed"
    type: Literal["request.completed"] = "request.completed"

    output_tokens: Annotated[int, Field(ge=0)]
    finish_reason: Literal["stop", "length"] = "stop"
    ttft_s: Annotated[float, Field(ge=0)] | None = None
    # TBT as FAST'25 scores it: mean of the slowest 10 % of inter-token gaps.
    tbt_s: Annotated[float, Field(ge=0)] | None = None
    text: str | None = None


class RequestFailed(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.failed"
    type: Literal["request.failed"] = "request.failed"

    reason: Annotated[str, Field(min_length=1, max_length=64)]
    stage: Literal["admission", "prefill", "decode", "store", "unknown"] = "unknown"
    detail: Annotated[str, Field(max_length=2000)] = ""


class CancelRequested(RequestEvent):
    """A command-like fact: somebody asked for the request to stop."""

    SUBJECT: ClassVar[str] = "mc.req.cancel"
    type: Literal["request.cancel_requested"] = "request.cancel_requested"

    reason: Annotated[str, Field(max_length=200)] = "client"


class RequestCancelled(RequestEvent):
    SUBJECT: ClassVar[str] = "mc.req.cancelled"
    type: Literal["request.cancelled"] = "request.cancelled"

    reason: Annotated[str, Field(max_length=200)] = "client"
    stage: Literal["admission", "prefill", "decode", "unknown"] = "unknown"


# --- metadata journal: store objects and instances ----------------------------------------


class Replica(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node: SubjectToken
    segment: Annotated[str, Field(max_length=128)]
    tier: Literal["dram", "ssd"] = "dram"


class KvObjectStored(Event):
    SUBJECT: ClassVar[str] = "mc.meta.kv.stored"
    type: Literal["kv.object.stored"] = "kv.object.stored"

    key: Annotated[str, Field(min_length=1, max_length=256)]
    size_bytes: Annotated[int, Field(ge=0)]
    replicas: list[Replica]
    pin: Literal["none", "soft", "hard"] = "none"


class KvObjectRemoved(Event):
    SUBJECT: ClassVar[str] = "mc.meta.kv.removed"
    type: Literal["kv.object.removed"] = "kv.object.removed"

    key: Annotated[str, Field(min_length=1, max_length=256)]
    reason: Literal["removed", "evicted", "node_lost", "revoked", "reclaimed"] = "removed"


class InstanceRegistered(Event):
    SUBJECT: ClassVar[str] = "mc.meta.instance.registered"
    type: Literal["instance.registered"] = "instance.registered"

    instance_id: SubjectToken
    role: Literal["prefill", "decode", "store", "store_master", "conductor", "recorder", "gateway"]
    host: Annotated[str, Field(max_length=255)] = ""
    endpoint: Annotated[str, Field(max_length=255)] = ""
    capacity: dict[str, float] = {}


class InstanceDeregistered(Event):
    SUBJECT: ClassVar[str] = "mc.meta.instance.deregistered"
    type: Literal["instance.deregistered"] = "instance.deregistered"

    instance_id: SubjectToken
    reason: Annotated[str, Field(max_length=200)] = "shutdown"


# --- the registry --------------------------------------------------------------------------

EVENT_CLASSES: tuple[type[Event], ...] = (
    RequestSubmitted,
    RequestAdmitted,
    RequestRejected,
    PrefillStarted,
    RequestPrefilled,
    DecodeStarted,
    DecodePreempted,
    DecodeResumed,
    DecodeStopped,
    TokensNotStored,
    RequestCompleted,
    RequestFailed,
    CancelRequested,
    RequestCancelled,
    KvObjectStored,
    KvObjectRemoved,
    InstanceRegistered,
    InstanceDeregistered,
)


def _type_of(cls: type[Event]) -> str:
    default = cls.model_fields["type"].default
    assert isinstance(default, str)
    return default


TYPE_TO_CLASS: dict[str, type[Event]] = {_type_of(c): c for c in EVENT_CLASSES}
SUBJECT_TO_TYPE: dict[str, str] = {c.SUBJECT: _type_of(c) for c in EVENT_CLASSES}
TYPE_TO_SUBJECT: dict[str, str] = {t: s for s, t in SUBJECT_TO_TYPE.items()}

AnyEvent = Annotated[
    RequestSubmitted
    | RequestAdmitted
    | RequestRejected
    | PrefillStarted
    | RequestPrefilled
    | DecodeStarted
    | DecodePreempted
    | DecodeResumed
    | DecodeStopped
    | TokensNotStored
    | RequestCompleted
    | RequestFailed
    | CancelRequested
    | RequestCancelled
    | KvObjectStored
    | KvObjectRemoved
    | InstanceRegistered
    | InstanceDeregistered,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Event] = TypeAdapter(AnyEvent)


# --- parsing at ingress ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InvalidEvent:
    """Why a message could not become an event, and its request id if one was readable."""

    reason: str
    detail: str
    request_id: str | None = None
    reply_to: str | None = None  # where the submitter listens, if that was readable


_REQUEST_ID_RE = re.compile(rb'"request_id"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')
_REPLY_TO_RE = re.compile(rb'"reply_to"\s*:\s*"([A-Za-z0-9_.-]{1,256})"')


def sniff_request_id(data: bytes) -> str | None:
    """Best-effort request id from a message that did not validate (or was too large to)."""
    match = _REQUEST_ID_RE.search(data[:65536])
    return match.group(1).decode() if match else None


def sniff_reply_to(data: bytes) -> str | None:
    """Best-effort `reply_to` of a message that did not validate: a literal subject only (as
    `RequestSubmitted.reply_to` must be), so a rejection can still reach its submitter."""
    match = _REPLY_TO_RE.search(data[:65536])
    if match is None:
        return None
    subject = match.group(1).decode()
    return subject if re.fullmatch(REPLY_SUBJECT_PATTERN, subject) else None


def _invalid(reason: str, detail: str, data: bytes) -> InvalidEvent:
    return InvalidEvent(reason, detail, sniff_request_id(data), sniff_reply_to(data))


LONE_SURROGATE = (
    "a string holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
    "which is not text"
)


def unencodable(data: Any, path: str = "") -> str | None:
    """The path (`messages.0.content`) of the first string in parsed JSON that is not valid
    Unicode text (JSON's `\\ud800` escapes allow lone surrogates, which no UTF-8 encoder,
    tokenizer or database takes), or None."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(data, dict):
        items: Any = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return None
    for key, value in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and unencodable(key) is not None:
            return here
        if (found := unencodable(value, here)) is not None:
            return found
    return None


def _surrogate_detail(data: bytes) -> str | None:
    """Why JSON that pydantic refused is not text, if that is why: Python's own parser takes
    lone surrogate escapes that pydantic's refuses ("unexpected end of hex escape")."""
    try:
        found = unencodable(json.loads(data))
    except (ValueError, RecursionError):  # nested past Python's stack: pydantic said why
        return None
    if found is None:
        return None
    return f"{found.encode('utf-8', 'backslashreplace').decode() or '<root>'}: {LONE_SURROGATE}"


def parse_event(
    data: bytes, *, subject: str | None = None, max_bytes: int | None = None
) -> Event | InvalidEvent:
    """Validate raw bytes into an event; never raises.

    When `subject` is given, the event's type must be the one registered for it, so a
    message cannot smuggle an `admitted` fact through the public `submitted` subject.
    """
    if max_bytes is not None and len(data) > max_bytes:
        return _invalid(
            "payload_too_large", f"{len(data)} bytes exceeds the limit of {max_bytes}", data
        )
    try:
        event = _ADAPTER.validate_json(data)
    except ValidationError as exc:
        return _invalid("invalid_request", _surrogate_detail(data) or _summarise(exc), data)
    except (ValueError, UnicodeDecodeError) as exc:  # pragma: no cover - pydantic wraps most
        return _invalid("invalid_request", str(exc)[:500], data)
    if subject is not None:
        expected = SUBJECT_TO_TYPE.get(subject)
        if expected is not None and expected != event.type:
            rid = getattr(event, "request_id", None)
            return InvalidEvent(
                "invalid_request", f"type {event.type!r} cannot be sent to {subject!r}", rid
            )
    return event


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def event_from_payload(payload: dict[str, Any]) -> Event:
    """Rebuild an event from the JSON stored in the `events` table (replay)."""
    return _ADAPTER.validate_python(payload)
