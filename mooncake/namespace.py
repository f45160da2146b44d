"""Streams and namespaces: the canonical names (`mc.*` subjects, `MC_*` streams) and their
mapping into a deployment's namespace, so several deployments (or a test run) can share one
NATS server without meeting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


class HasSubject(Protocol):
    SUBJECT: ClassVar[str]


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    work_queue: bool = False
    max_age_s: float | None = None  # None: kept until limits (or, work queues, until acked)


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("MC_REQ", ("mc.req.>",)),
    StreamSpec("MC_META", ("mc.meta.>",)),
    StreamSpec("MC_DLQ", ("mc.dlq.>",)),
    # Work for one prefill / decode instance: a message leaves when its work is acked.
    StreamSpec("MC_WORK", ("mc.prefill.>", "mc.decode.>"), work_queue=True),
    # A batched copy of every request's streamed tokens, so a client can resume from an offset.
    StreamSpec("MC_TOKENS", ("mc.tokens.>",), max_age_s=3600.0),
)
DEFAULT_NAMESPACE = "mc"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Maps the canonical names above (`mc.*` subjects, `MC_*` streams) into a namespace,
    so several deployments (or a test run) can share one NATS server without meeting.

    Subjects in this module, and the ones `parse_event` checks, are always canonical.
    """

    prefix: str = DEFAULT_NAMESPACE

    def subject(self, canonical: str) -> str:
        return self.prefix + canonical[len(DEFAULT_NAMESPACE) :]

    def of(self, event: HasSubject | type[HasSubject]) -> str:
        return self.subject(event.SUBJECT)

    def canonical(self, subject: str) -> str:
        if subject.startswith(self.prefix + "."):
            return DEFAULT_NAMESPACE + subject[len(self.prefix) :]
        return subject

    def stream(self, canonical: str) -> str:
        return self.prefix.upper() + canonical[len(DEFAULT_NAMESPACE) :]

    def streams(self) -> tuple[StreamSpec, ...]:
        return tuple(
            StreamSpec(
                self.stream(s.name),
                tuple(self.subject(x) for x in s.subjects),
                s.work_queue,
                s.max_age_s,
            )
            for s in STREAMS
        )

    def dead_letter_subject(self, consumer: str) -> str:
        return self.subject(f"mc.dlq.{consumer}")
