"""The requests one decode instance holds, and where each one is.

A request's work message stays held (unacked, heartbeated) from the moment it arrives until
the request ends here, so an instance that dies leaves its work for redelivery. In between:

    receiving -> waiting -> loading -> ready -> running -> (ended)
                    ^                              |
                    +---------- preempted ---------+

- receiving: just delivered (is it ended already? `DecodeStarted` is published);
- waiting: for pages (core.kv_admission), in FIFO order; a preempted request goes back in
  front, ahead of new work;
- loading: its pages are reserved and its prompt's KV is on its way from the store;
- ready: its KV is loaded; what is missing is computed when it joins the batch;
- running: in the batch, one token per step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from opentelemetry.trace import Span

from mooncake.bus.consume import Delivery
from mooncake.serving.decode_kv import PromptKV, context_tokens
from mooncake.serving.streaming import TextDeltas
from mooncake.work import DecodeWork

Stage = Literal["receiving", "waiting", "loading", "ready", "running"]


@dataclass
class Job:
    work: DecodeWork
    delivery: Delivery
    texts: TextDeltas
    span: Span
    first_text: str = ""  # the text of index 0 (streamed by prefill)
    stage: Stage = "receiving"
    prompt: PromptKV | None = None  # its sequence in the pool, once pages are reserved
    load: asyncio.Task[None] | None = None
    output: list[int] = field(default_factory=list)  # tokens so far, kept across preemptions
    sent: int = 1  # next output index to stream (index 0 came from prefill)
    times: list[float] = field(default_factory=list)  # monotonic time of each token here
    stop: str | None = None  # why it must leave early: client | deadline | ended:<how>
    preemptions: int = 0
    preempted_at: float | None = None  # monotonic, while it waits to resume
    preempted_span: Span | None = None

    @property
    def rid(self) -> str:
        return self.work.request_id

    @property
    def context(self) -> int:
        """KV tokens it holds when it (re)joins the batch."""
        return context_tokens(self.work, self.output)

    def release(self) -> None:
        """Give its pages back (a job that leaves before it runs, or is preempted)."""
        if self.prompt is not None:
            self.prompt.kv.release()
            self.prompt = None


class Jobs:
    """The jobs by request id, and the FIFO of those waiting for pages."""

    def __init__(self) -> None:
        self.by_id: dict[str, Job] = {}
        self.waiting: deque[Job] = deque()

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self.by_id.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> Job | None:
        return self.by_id.get(request_id)

    def add(self, job: Job) -> None:
        self.by_id[job.rid] = job

    def wait(self, job: Job, *, first: bool = False) -> None:
        """Queue for pages: new work at the back, preempted work in front."""
        job.stage = "waiting"
        if first:
            self.waiting.appendleft(job)
        else:
            self.waiting.append(job)

    def remove(self, job: Job) -> None:
        if self.by_id.get(job.rid) is job:
            del self.by_id[job.rid]
        if job in self.waiting:
            self.waiting.remove(job)

    def in_stage(self, *stages: Stage) -> list[Job]:
        return [j for j in self.by_id.values() if j.stage in stages]

    @property
    def held(self) -> int:
        """Jobs taken from the queue that are not in the batch."""
        return sum(1 for j in self.by_id.values() if j.stage != "running")
