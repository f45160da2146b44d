"""Messages between the pipeline's stages that are not lifecycle facts.

- `PrefillWork` on `mc.prefill.<instance>` and `DecodeWork` on `mc.decode.<instance>`
  (JetStream work queues, stream MC_WORK): the work one instance must do. A message stays
  until the instance acks it (when its effect is durable); an instance that dies leaves it
  pending, and the Conductor re-dispatches it to a live instance with `attempt + 1`.
- `LoadReport` on `mc.load.<instance>` (core NATS, periodic): what an instance is doing now;
  the Conductor's ClusterView folds them, and their absence marks an instance dead.
- `TokenChunk` on the request's `reply_to` subject (core NATS) and, batched, on
  `mc.tokens.<digest of request id>` (stream MC_TOKENS) so a client can resume from an offset.

Lifecycle facts (`mooncake.events`) stay the record; these are the pipeline's plumbing.
Every message is validated once where it arrives (`extra="forbid"`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mooncake.events import Identifier, SamplingParams, SubjectToken, derived_event_id
from mooncake.hashing import DEFAULT_CACHE_NAMESPACE, DEFAULT_TENANT
from mooncake.namespace import Namespace

TokenId = Annotated[int, Field(ge=0)]
Key = Annotated[str, Field(min_length=1, max_length=256)]
ReplySubject = Annotated[str, Field(max_length=256, pattern=r"^[A-Za-z0-9_.>*-]+$")]


class Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


class Timing(Wire):
    """Wall-clock stamps (unix seconds) a request carries through the stages."""

    submitted_at: float
    deadline_at: float | None = None  # past it, the request is cancelled wherever it is


class CppStage(Wire):
    """This instance's part in a chunked-pipeline prefill (docs/cpp.md): stage `stage` of
    the group `group` (stage 0 leads: it holds the request's work, starts the KV put and
    hands the request over to decode), over the chunks [start, end) of the prompt."""

    group: Annotated[list[SubjectToken], Field(min_length=2, max_length=64)]
    stage: Annotated[int, Field(ge=0, le=63)]
    chunks: Annotated[list[tuple[TokenId, TokenId]], Field(min_length=1, max_length=1 << 16)]

    @model_validator(mode="after")
    def _plan(self) -> CppStage:
        if self.stage >= len(self.group):
            raise ValueError(f"stage {self.stage} of a group of {len(self.group)}")
        if len(set(self.group)) != len(self.group):
            raise ValueError("an instance appears twice in the group")
        end = self.chunks[0][0]
        for a, b in self.chunks:
            if a != end or b <= a:
                raise ValueError("chunks must follow each other, each at least one token")
            end = b
        return self


class PrefillWork(Wire):
    request_id: Identifier
    attempt: Annotated[int, Field(ge=1)] = 1
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    params: SamplingParams = SamplingParams()
    reply_to: ReplySubject | None = None
    prefill_instance: SubjectToken
    decode_instance: SubjectToken
    timing: Timing
    # The Conductor's plan: whole blocks of the prompt to load from the store rather than
    # compute (local: already on this instance's node; the rest: fetched and kept as a copy).
    cached_blocks: Annotated[int, Field(ge=0)] = 0
    local_blocks: Annotated[int, Field(ge=0)] = 0
    # Set where the Conductor's cost model judged loading more of the cached prefix than
    # this many leading blocks slower than computing it (core/cost_model.py `reuse`;
    # 0: recompute it all): the prefill loads no more from the store. None: every leading
    # block the store holds when the prefill runs (those stored since the decision too).
    load_limit_blocks: Annotated[int, Field(ge=0)] | None = None
    # Event id of the admission, so the events a stage emits get ids derived from it.
    admitted_event_id: Identifier
    # The request's cache namespace (`hashing.cache_namespace`): its blocks' keys are salted
    # with it and the model id (`hashing.cache_salt`).
    cache_namespace: Annotated[str, Field(max_length=128)] = DEFAULT_CACHE_NAMESPACE
    tenant: SubjectToken = DEFAULT_TENANT
    # Prefilled by a group (CPP) rather than by one instance: this instance's stage.
    cpp: CppStage | None = None


class DecodeWork(Wire):
    request_id: Identifier
    attempt: Annotated[int, Field(ge=1)] = 1
    token_ids: Annotated[list[TokenId], Field(min_length=1)]  # the prompt
    first_token_id: TokenId  # sampled by prefill: the request's first output token
    # The prompt's KV in the store: whole blocks under their chained keys, then the partial
    # last block (fewer than block_tokens tokens) under a request-scoped key.
    kv_keys: list[Key] = []
    tail_key: Key | None = None
    tail_tokens: Annotated[int, Field(ge=0)] = 0
    params: SamplingParams = SamplingParams()
    reply_to: ReplySubject | None = None
    prefill_instance: SubjectToken
    decode_instance: SubjectToken
    timing: Timing
    first_token_at: float  # unix seconds: TTFT = first_token_at - submitted_at
    admitted_event_id: Identifier


class EngineTiming(Wire):
    """One timing of the engine at worker start: a prefill of `x` tokens with `z` of them
    cached, or a decode step of a batch of `x` sequences holding `z` KV tokens."""

    x: Annotated[int, Field(ge=1)]
    z: Annotated[int, Field(ge=0)]
    seconds: Annotated[float, Field(gt=0)]


class LoadReport(Wire):
    instance: SubjectToken
    role: Literal["prefill", "decode"]
    node: SubjectToken  # the store node whose DRAM is this instance's local cache
    seq: Annotated[int, Field(ge=1)]
    at: float  # unix seconds
    queued: Annotated[int, Field(ge=0)] = 0  # requests waiting
    queued_tokens: Annotated[int, Field(ge=0)] = 0  # prompt tokens still to compute (prefill)
    running: Annotated[int, Field(ge=0)] = 0  # requests being computed (decode: batch size)
    context_tokens: Annotated[int, Field(ge=0)] = 0  # decode: KV tokens in the batch
    # Decode: the KV pool (engine.pool): its whole capacity, what it can hand out now (free
    # pages and cached blocks nobody holds, in tokens), its page size, and the preemptions
    # it has made since the worker started.
    kv_capacity_tokens: Annotated[int, Field(ge=0)] | None = None
    kv_free_tokens: Annotated[int, Field(ge=0)] | None = None
    kv_page_tokens: Annotated[int, Field(ge=1)] | None = None
    preemptions: Annotated[int, Field(ge=0)] = 0
    # Decode: the steps since the previous report, their mean period (one token of every
    # running sequence, the TBT they saw) and the mean batch and KV tokens they ran with.
    steps: Annotated[int, Field(ge=0)] = 0
    step_s: Annotated[float, Field(gt=0)] | None = None
    step_batch: Annotated[float, Field(gt=0)] | None = None
    step_context_tokens: Annotated[float, Field(ge=0)] | None = None
    # The engine's timings at start (prefill: prefills; decode: steps), in every report, so
    # a Conductor that starts later still gets them with the instance's first report.
    calibration: list[EngineTiming] = []


class TokenChunk(Wire):
    """Output tokens `index .. index + len(token_ids) - 1` of a request, and the text they
    add. The last chunk has `done` and the finish reason (or `error`)."""

    request_id: Identifier
    index: Annotated[int, Field(ge=0)]
    token_ids: list[TokenId] = []
    text: str = ""
    done: bool = False
    finish_reason: Literal["stop", "length", "cancelled", "failed"] | None = None
    error: Annotated[str, Field(max_length=2000)] | None = None


class TokenBatch(Wire):
    """One message on MC_TOKENS: consecutive chunks of one request, and whose they are
    (`owner_digest` of the request's `reply_to`; None where it had none)."""

    chunks: list[TokenChunk]
    owner: Annotated[str, Field(max_length=64)] | None = None


def owner_digest(reply_to: str) -> str:
    """Who may read a request's copy through the read-back service: whoever knows the
    request's reply subject. An inbox is random and only the submitter and the roles that
    read submissions see it, so knowing it proves the ask comes from the submitter; the copy
    keeps only this digest of it."""
    return hashlib.blake2b(reply_to.encode(), digest_size=16).hexdigest()


def inbox_owner(subject: str) -> str:
    """The inbox prefix a reply subject lives under (`_INBOX.gateway` for
    `_INBOX.gateway.<nuid>`, or for a request's `_INBOX.gateway.<nuid>.<token>` reply): with
    per-user inbox prefixes (deploy/nats/auth.conf) it names the user who can read it."""
    parts = subject.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[0] == "_INBOX" else ""


# How many chunks one read-back answer holds at most (a NATS message is at most 1 MiB: a
# chunk is one token with its text, so 512 stay far below it).
READ_BACK_MAX_CHUNKS = 512


class ReadBackAsk(Wire):
    """To the read-back service (`mc.readback.tokens`, request/reply): the stored chunks of
    `request_id` from `from_index` on. `reply_to` is the request's own reply subject: the
    proof that the asker submitted it (`owner_digest`)."""

    request_id: Identifier
    reply_to: ReplySubject
    from_index: Annotated[int, Field(ge=0)] = 0
    max_chunks: Annotated[int, Field(ge=1, le=READ_BACK_MAX_CHUNKS)] = READ_BACK_MAX_CHUNKS


class ReadBackAnswer(Wire):
    """What the copy holds from the asked index on, in index order, each index once (the
    final chunk last, if stored); `more` when `max_chunks` cut it short; `error` (and no
    chunks) when the ask is refused: not the asker's request or unreadable, or (`retry`) the
    service busy or the stream unavailable."""

    chunks: list[TokenChunk] = []
    more: bool = False
    error: Annotated[str, Field(max_length=500)] | None = None
    retry: bool = False  # the refusal is for now (busy, the stream unavailable): ask again


def token_stream_token(request_id: str) -> str:
    """A subject token for a request id (ids may hold '.', which subjects cannot)."""
    return hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


class WorkSubjects:
    def __init__(self, ns: Namespace) -> None:
        self.ns = ns

    def prefill(self, instance: str) -> str:
        return self.ns.subject(f"mc.prefill.{instance}")

    def decode(self, instance: str) -> str:
        return self.ns.subject(f"mc.decode.{instance}")

    def load(self, instance: str = "*") -> str:
        return self.ns.subject(f"mc.load.{instance}")

    def tokens(self, request_id: str) -> str:
        return self.ns.subject(f"mc.tokens.{token_stream_token(request_id)}")

    def cancel(self) -> str:
        return self.ns.subject("mc.req.cancel")

    def cpp(self, instance: str) -> str:
        """Where a prefill instance answers the members of the CPP groups it leads (core
        NATS request-reply, outside every stream's subjects)."""
        return self.ns.subject(f"mc.cpp.{instance}")

    def read_back(self) -> str:
        """The token read-back service (outside every stream's subjects)."""
        return self.ns.subject("mc.readback.tokens")


def tail_key(request_id: str, attempt: int) -> str:
    """Store key of a request's partial last KV block (never shared between requests)."""
    return f"tail:{token_stream_token(request_id)}:{attempt}"


def completed_event_id(admitted_event_id: str, stage: Literal["prefill", "decode"]) -> str:
    """The id of the `request.completed` a stage publishes: the same on every attempt, so a
    stage killed after claiming the request's end but before publishing it can be redone,
    wins the claim again and publishes the same event (`terminal.ended(redo=...)`)."""
    return derived_event_id(admitted_event_id, f"{stage}.completed")
