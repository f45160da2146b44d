"""A chunked-pipeline prefill on live prefill workers (CPP, issue 19, docs/cpp.md): the
leader's side (`CppGroups.lead`), a member's (`CppGroups.serve_stage`), and how they meet.

The work: the Conductor sends every stage of a group its `PrefillWork` carrying `cpp` (the
group, the stage, the chunks) in one decision, so each instance's queue holds groups in the
Conductor's order and no two groups wait on each other (gang order). Stage 0 leads: it
holds the request, starts the KV put and, once the group is done, hands the request over to
decode like any prefill (first token, `RequestPrefilled`, `DecodeWork`).

How a group meets (core NATS request-reply on the leader's `mc.cpp.<leader>`, `CppAsk` and
`CppAnswer`; the activations themselves never touch NATS):
1. Every stage opens an inbox (a fresh segment for this prefill, served by its store node's
   transports: `activations.Inbox`) and loads its cached prefix; a member then asks the
   leader to `join`, naming its inbox. The leader answers `wait` until it has started the
   put and every member has joined, then `go`, with the put to join (`SharedPut`) and the
   inbox of the stage after the asker (the last stage's is the leader's: the logits).
2. Chunks flow stage to stage (`cpp_stage.run_stage`); each stage writes its layers of each
   block into the shared put. Members `beat` while they run; the answer says whether the
   group is still on.
3. A member reports `done` with what it wrote (`PutHandle.written`); the leader, with the
   logits and every report in, credits them and commits: an object is published only once
   all its layers are in.

Failure: the leader gives the group up (`GroupFailed`) when a member does not join within
`cpp.gang_wait_s`, goes silent for `conductor.liveness_timeout_s`, reports an error, or the
pipeline breaks; it aborts the put (nothing half-written is published), and the caller
prefills the request alone. A member drops its stage when the leader answers `gone`, stays
silent for `liveness_timeout_s`, or does not start within `gang_wait_s`.

Each stage's pool holds only its own layers of the computed blocks, so a stage never offers
them to its pool's prefix cache (a later prefill there would read the other layers as
zeros); the cached prefix it loaded is whole, every layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import Field

from mooncake.aio import cancel_all
from mooncake.config import Settings
from mooncake.core.cpp import MAX_CHUNK_FACTOR, layer_ranges
from mooncake.engine import Engine, KVPoolExhausted, PagedKV, Prefilled
from mooncake.serving.activations import (
    RING_BYTES,
    SLOT_HEADER,
    Aborted,
    Inbox,
    Outbox,
)
from mooncake.serving.cpp_stage import StageBlockWriter, run_stage
from mooncake.serving.kvstore import (
    PrefillCancelled,
    PrefixLoader,
    PrefixLoadError,
    Target,
    leading_hits,
    loaded_tiers,
    write_targets,
)
from mooncake.serving.local_store import LocalStore
from mooncake.serving.prefill_kv import StoredPrefill
from mooncake.store import protocol as p
from mooncake.store.client import PutHandle
from mooncake.store.segment import Segment
from mooncake.store.types import Reason
from mooncake.work import PrefillWork, Wire, WorkSubjects, tail_key

log = logging.getLogger("mooncake.prefill.cpp")

ASK_TIMEOUT_S = 1.0  # one request-reply to the leader
JOIN_EVERY_S = 0.1  # a member asking to join again while the leader answers `wait`
BEAT_EVERY_S = 0.25
GONE_MEMORY = 4096  # groups this instance led that ended: a late ask is told `gone`


class GroupFailed(Exception):
    """The group could not prefill the request: the leader prefills it alone."""


class InboxAddress(Wire):
    """Where a stage's inbox is: its segment and the endpoint per transport serving it."""

    segment: Annotated[str, Field(min_length=1, max_length=256)]
    endpoints: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=8)]
    slots: Annotated[int, Field(ge=1, le=16)]
    slot_size: Annotated[int, Field(ge=SLOT_HEADER + 4)]


class CppAsk(Wire):
    request_id: Annotated[str, Field(min_length=1, max_length=256)]
    attempt: Annotated[int, Field(ge=1)]
    stage: Annotated[int, Field(ge=1, le=63)]
    kind: Literal["join", "beat", "done"]
    inbox: InboxAddress | None = None  # join
    written: dict[str, Annotated[int, Field(ge=0)]] = {}  # done: PutHandle.written()
    failed: list[str] = []
    error: Annotated[str, Field(max_length=1000)] | None = None  # done: the stage failed


class CppAnswer(Wire):
    state: Literal["wait", "go", "gone", "ok"]
    put: p.SharedPut | None = None  # go
    next: InboxAddress | None = None  # go: where the asker's output goes
    why: Annotated[str, Field(max_length=1000)] | None = None  # gone


def slot_size(rows: int, hidden: int, vocab: int, itemsize: int = 4) -> int:
    """A slot holds a chunk's hidden states, or the logits the last stage sends back."""
    return SLOT_HEADER + max(rows * hidden, vocab) * itemsize


def max_chunk_tokens(settings: Settings) -> int:
    """The longest chunk a stage takes (`core.cpp.capped`: the Conductor cuts no longer)."""
    return MAX_CHUNK_FACTOR * settings.cpp.chunk_tokens


def inbox_bytes_bound(settings: Settings, hidden: int, vocab: int) -> int:
    """The most a prefill worker's CPP inboxes hold at once (one prefill at a time: the
    inbox of a stage, or a leader's for the logits), for its stated memory bound; 0 where
    groups are off."""
    if settings.cpp.max_stages < 2:
        return 0
    rows = max_chunk_tokens(settings)
    return RING_BYTES + settings.cpp.slots * slot_size(rows, hidden, vocab)


@dataclass
class _OpenInbox:
    inbox: Inbox
    segment: Segment
    address: InboxAddress
    store: LocalStore

    def close(self) -> None:
        self.store.node.unserve(self.segment.info.segment_id)
        self.segment.close()


@dataclass
class _Session:
    """The leader's view of one group prefill (event-loop side)."""

    work: PrefillWork
    members: int  # stages 1..members
    own: InboxAddress  # the leader's inbox: the last stage sends the logits there
    share: p.SharedPut | None = None
    joined: dict[int, InboxAddress] = field(default_factory=dict)
    beats: dict[int, float] = field(default_factory=dict)
    reports: dict[int, CppAsk] = field(default_factory=dict)
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    all_joined: asyncio.Event = field(default_factory=asyncio.Event)
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    why: str | None = None

    def fail(self, why: str) -> None:
        if not self.abort.is_set():
            self.why = why
            self.abort.set()

    def answer(self, ask: CppAsk) -> CppAnswer:
        if self.abort.is_set():
            return CppAnswer(state="gone", why=self.why)
        if ask.stage > self.members:
            return CppAnswer(state="gone", why=f"no stage {ask.stage} in this group")
        self.beats[ask.stage] = time.monotonic()
        if ask.kind == "join":
            if ask.inbox is not None:
                self.joined[ask.stage] = ask.inbox
            if len(self.joined) == self.members:
                self.all_joined.set()
            if self.share is None or not self.all_joined.is_set():
                return CppAnswer(state="wait")
            nxt = self.joined.get(ask.stage + 1, self.own)
            return CppAnswer(state="go", put=self.share, next=nxt)
        if ask.kind == "done":
            self.reports[ask.stage] = ask
            if ask.error is not None:
                self.fail(f"stage {ask.stage} ({self.group[ask.stage]}) failed: {ask.error}")
                return CppAnswer(state="gone", why=self.why)
            if len(self.reports) == self.members:
                self.all_done.set()
        return CppAnswer(state="ok")

    @property
    def group(self) -> list[str]:
        assert self.work.cpp is not None
        return self.work.cpp.group

    def silent(self, now: float, after_s: float) -> int | None:
        """A member that joined and has not been heard of for `after_s`, if any."""
        for stage, at in self.beats.items():
            if stage not in self.reports and now - at > after_s:
                return stage
        return None


async def _until(event: asyncio.Event, abort: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event`; False if `abort` is set first or `timeout_s` passes."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(abort.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return event.is_set() and not abort.is_set()


class CppGroups:
    """A prefill worker's part in CPP groups: the groups it leads (and answers the members
    of) and the stages it serves for others."""

    def __init__(
        self,
        nc: NATS,
        subjects: WorkSubjects,
        instance: str,
        engine: Engine,
        store: LocalStore,
        settings: Settings,
    ) -> None:
        self.nc, self.subjects, self.instance = nc, subjects, instance
        self.engine, self.store, self.settings = engine, store, settings
        self._sessions: dict[tuple[str, int], _Session] = {}
        self._gone: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.cpp(self.instance), cb=self._on_ask)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_ask(self, msg: Msg) -> None:
        try:
            ask = CppAsk.model_validate_json(msg.data)
        except ValueError as exc:
            answer = CppAnswer(state="gone", why=f"unreadable ask: {exc}"[:1000])
        else:
            key = (ask.request_id, ask.attempt)
            session = self._sessions.get(key)
            if session is not None:
                answer = session.answer(ask)
            elif key in self._gone:
                answer = CppAnswer(state="gone", why=self._gone[key])
            else:
                answer = CppAnswer(state="wait")  # not started here yet (its queue)
        if msg.reply:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, answer.to_json())

    def _forget(self, key: tuple[str, int], why: str) -> None:
        self._sessions.pop(key, None)
        self._gone[key] = why
        while len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)

    # --- pieces both sides use ---------------------------------------------------------------

    @property
    def _liveness_s(self) -> float:
        return self.settings.conductor.liveness_timeout_s

    def _layers(self, stage: int, stages: int) -> tuple[int, int]:
        return layer_ranges(len(self.engine.model.layers), stages)[stage]

    def _open_inbox(self, rows: int) -> _OpenInbox:
        spec = self.engine.spec
        slots = self.settings.cpp.slots
        size = slot_size(rows, spec.hidden, spec.vocab_size)
        seg_id = f"{self.instance}-cpp-{uuid.uuid4().hex[:12]}"
        segment = Segment.create_dram(seg_id, self.instance, RING_BYTES + slots * size)
        try:
            endpoints = self.store.node.serve(segment)
            inbox = Inbox(segment, slots, size)
        except BaseException:
            segment.close()
            raise
        address = InboxAddress(segment=seg_id, endpoints=endpoints, slots=slots, slot_size=size)
        return _OpenInbox(inbox, segment, address, self.store)

    def _outbox(self, to: InboxAddress) -> Outbox:
        route = self.store.client.route(to.endpoints)
        if route is None:
            raise GroupFailed(f"no transport here reaches inbox {to.segment}")
        transport, endpoint = route
        return Outbox(transport, endpoint, to.segment, to.slots, to.slot_size)

    async def _load_prefix(self, kv: PagedKV, keys: Sequence[str], tokens: int) -> dict[str, int]:
        """Reserve the prompt's pages and load the first `len(keys)` blocks, every layer.
        Returns the loaded blocks per tier (`kvstore.loaded_tiers`)."""
        size_t, layout = self.engine.block_tokens, self.engine.layout
        if not kv.reserve(tokens):
            raise KVPoolExhausted(f"no room in the KV pool for a prompt of {tokens} tokens")
        if not keys:
            return {}
        handle = await self.store.client.start_get(keys)
        if leading_hits([handle.size(k) for k in keys], layout.object_size(size_t)) < len(keys):
            raise PrefixLoadError("the cached prefix is no longer (all) in the store")
        loader = PrefixLoader(handle, keys, layout, size_t, kv)
        await loader.fill()
        kv.length = len(keys) * size_t
        return loaded_tiers(handle, keys, self.store.dram_segment)

    def _plan(self, work: PrefillWork) -> tuple[list[str], int, list[Target]]:
        """The prompt's block keys, the cached blocks the chunks start after, and the
        objects the group writes."""
        assert work.cpp is not None
        engine, size_t = self.engine, self.engine.block_tokens
        engine.check_tokens(work.token_ids)
        keys = engine.block_keys(work.token_ids, work.cache_namespace)
        start, end = work.cpp.chunks[0][0], work.cpp.chunks[-1][1]
        if end != len(work.token_ids) or start % size_t or start // size_t > len(keys):
            raise GroupFailed(
                f"chunks [{start}, {end}) do not fit a prompt of {len(work.token_ids)} tokens"
            )
        longest = max(b - a for a, b in work.cpp.chunks)
        if longest > max_chunk_tokens(self.settings):
            raise GroupFailed(f"a chunk of {longest} tokens is longer than a stage takes")
        n = start // size_t
        return keys, n, write_targets(keys, end, size_t, n, tail_key(work.request_id, work.attempt))

    # --- the leader ------------------------------------------------------------------------

    async def lead(self, work: PrefillWork, cancelled: threading.Event) -> StoredPrefill:
        """Prefill `work` as stage 0 of its group. GroupFailed: the group was given up (the
        put aborted); PrefillCancelled: `cancelled` was set; EngineError: a bad prompt."""
        assert work.cpp is not None and work.cpp.stage == 0
        cpp, key = work.cpp, (work.request_id, work.attempt)
        keys, n, targets = self._plan(work)
        box = self._open_inbox(1)  # the logits come back: one row of the vocabulary
        session = _Session(work, len(cpp.group) - 1, box.address)
        self._sessions[key] = session
        kv = self.engine.new_kv()
        put: PutHandle | None = None
        watch = asyncio.create_task(self._watch(session, cancelled))
        outcome = "given up"
        try:
            try:
                loaded_from = await self._load_prefix(kv, keys[:n], len(work.token_ids))
                put = await self.store.client.start_put(
                    [(t.key, self.engine.layout.object_size(t.tokens)) for t in targets],
                    preferred_segment=self.store.dram_segment, owner=work.cache_namespace,
                )  # fmt: skip
                session.share = put.share()
                gang = self.settings.cpp.gang_wait_s
                if not await _until(session.all_joined, session.abort, gang):
                    missing = [cpp.group[s] for s in range(1, len(cpp.group))
                               if s not in session.joined]  # fmt: skip
                    session.fail(session.why or f"{', '.join(missing)} did not start in {gang:g} s")
                    raise Aborted(session.why)
                outbox = self._outbox(session.joined[1])
                mine = [t for t in targets if t.key in set(put.keys)]
                layers = self._layers(0, len(cpp.group))
                writer = StageBlockWriter(put, self.engine.layout, kv, layers, mine, header=True)
                await run_stage(self.engine, kv, layers, cpp.chunks, work.token_ids, inbox=None,
                                outbox=outbox, writer=writer, abort=session.abort)  # fmt: skip
                logits = (await box.inbox.receive(abort=session.abort))[0]
                if not await _until(session.all_done, session.abort, 600.0):
                    session.fail(session.why or "the members did not report")
                    raise Aborted(session.why)
                for report in session.reports.values():
                    put.credit(report.written, report.failed)
                results, put = await put.commit(), None
            except Exception as exc:  # whatever broke the group: the leader goes on alone
                session.fail(session.why or f"{type(exc).__name__}: {exc}")
                if cancelled.is_set():
                    raise PrefillCancelled("cancelled while its group prefilled it") from exc
                raise GroupFailed(session.why) from exc
            lost = [k for k, r in results.items()
                    if r is not None and r.reason not in (Reason.EXISTS, Reason.QUOTA)]  # fmt: skip
            if lost:
                first = results[lost[0]]
                assert first is not None
                raise GroupFailed(
                    f"{len(lost)} of the group's KV objects were not stored (the first: "
                    f"{first.reason.value} {first.detail})"
                )
            outcome = "done"
        except BaseException as exc:
            session.fail(session.why or f"{type(exc).__name__}: {exc}")
            if put is not None:
                with contextlib.suppress(Exception):
                    await put.abort()
            kv.release()
            raise
        finally:
            await _stop(watch)
            self._forget(key, outcome if outcome == "done" else (session.why or outcome))
            box.close()
        tail = targets[-1] if targets and targets[-1].key == tail_key(*key) else None
        size_t = self.engine.block_tokens
        return StoredPrefill(
            prefilled=Prefilled(list(work.token_ids), kv, logits.float(), n * size_t),
            block_keys=keys, loaded_blocks=n,
            tail_key=tail.key if tail is not None else None,
            tail_tokens=tail.tokens if tail is not None else 0,
            written=[t.key for t in targets if results.get(t.key) is None],
            loaded_from=loaded_from, namespace=work.cache_namespace,
        )  # fmt: skip

    async def _watch(self, session: _Session, cancelled: threading.Event) -> None:
        """Give the group up when the request is cancelled or a member goes silent."""
        while not session.abort.is_set():
            if cancelled.is_set():
                session.fail("cancelled")
            elif (s := session.silent(time.monotonic(), self._liveness_s)) is not None:
                session.fail(f"stage {s} ({session.group[s]}) went silent")
            await asyncio.sleep(0.05)

    # --- a member ----------------------------------------------------------------------------

    async def serve_stage(self, work: PrefillWork, cancelled: threading.Event) -> str | None:
        """Run stage `work.cpp.stage` of the group its leader leads. Returns None when the
        stage did its part, else why it dropped it (the leader prefills the request alone)."""
        assert work.cpp is not None and work.cpp.stage > 0
        cpp = work.cpp
        stage, last = cpp.stage, cpp.stage == len(cpp.group) - 1
        ask = self._asker(work)
        rows = max(b - a for a, b in cpp.chunks)
        box = self._open_inbox(rows)
        kv = self.engine.new_kv()
        abort = asyncio.Event()
        beat: asyncio.Task[None] | None = None
        try:
            try:
                keys, n, targets = self._plan(work)
                await self._load_prefix(kv, keys[:n], len(work.token_ids))
                go = await self._join(ask, box.address, cancelled)
                if go.state != "go" or go.put is None or go.next is None:
                    return go.why or "the group was given up before it started"
                joined = self.store.client.join_put(go.put)
                outbox = self._outbox(go.next)
                beat = asyncio.create_task(self._beat(ask, abort, cancelled))
                mine = [t for t in targets if t.key in set(joined.keys)]
                layers = self._layers(stage, len(cpp.group))
                writer = StageBlockWriter(joined, self.engine.layout, kv, layers, mine,
                                          header=False)  # fmt: skip
                logits = await run_stage(self.engine, kv, layers, cpp.chunks, work.token_ids,
                                         inbox=box.inbox, outbox=None if last else outbox,
                                         writer=writer, abort=abort)  # fmt: skip
                if last:
                    assert logits is not None
                    await outbox.send(logits.float()[None], abort=abort)
                written, failed = joined.written()
            except Exception as exc:
                why = "cancelled" if cancelled.is_set() else f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(Exception):
                    await ask("done", error=why[:1000])
                return why
            await _stop(beat)
            answer = await self._report(ask, written, sorted(failed))
            return None if answer is None or answer.state == "ok" else (answer.why or "gone")
        finally:
            await _stop(beat)
            kv.release()
            box.close()

    def _asker(self, work: PrefillWork) -> Callable[..., Awaitable[CppAnswer]]:
        assert work.cpp is not None
        subject = self.subjects.cpp(work.cpp.group[0])
        base = {"request_id": work.request_id, "attempt": work.attempt, "stage": work.cpp.stage}

        async def ask(kind: str, **extra: object) -> CppAnswer:
            msg = CppAsk.model_validate({**base, "kind": kind, **extra})
            reply = await self.nc.request(subject, msg.to_json(), timeout=ASK_TIMEOUT_S)
            return CppAnswer.model_validate_json(reply.data)

        return ask

    async def _join(
        self, ask: Callable[..., Awaitable[CppAnswer]], own: InboxAddress,
        cancelled: threading.Event,
    ) -> CppAnswer:  # fmt: skip
        """Ask to join until the leader says go (or gone); `gone` with why on a leader that
        stays silent, a cancel, or a wait past `gang_wait_s`."""
        started = heard = time.monotonic()
        while True:
            if cancelled.is_set():
                return CppAnswer(state="gone", why="cancelled")
            try:
                answer = await ask("join", inbox=own)
                heard = time.monotonic()
            except Exception:  # no answer: the leader is busy computing, or dead
                answer = None
            now = time.monotonic()
            if answer is not None and answer.state in ("go", "gone"):
                return answer
            if now - heard > self._liveness_s:
                return CppAnswer(state="gone", why="the leader does not answer")
            if now - started > self.settings.cpp.gang_wait_s:
                return CppAnswer(state="gone", why="the leader did not start the group in time")
            await asyncio.sleep(JOIN_EVERY_S)

    async def _beat(
        self, ask: Callable[..., Awaitable[CppAnswer]], abort: asyncio.Event,
        cancelled: threading.Event,
    ) -> None:  # fmt: skip
        heard = time.monotonic()
        while not abort.is_set():
            if cancelled.is_set():
                abort.set()
                return
            try:
                answer = await ask("beat")
                heard = time.monotonic()
                if answer.state == "gone":
                    abort.set()
                    return
            except Exception:
                if time.monotonic() - heard > self._liveness_s:
                    abort.set()  # the leader is gone: so is the group
                    return
            await asyncio.sleep(BEAT_EVERY_S)

    async def _report(
        self, ask: Callable[..., Awaitable[CppAnswer]], written: dict[str, int],
        failed: list[str],
    ) -> CppAnswer | None:  # fmt: skip
        """What this stage wrote, to the leader (until it answers, or goes silent)."""
        heard = time.monotonic()
        while time.monotonic() - heard <= self._liveness_s:
            try:
                return await ask("done", written=written, failed=failed)
            except Exception:
                await asyncio.sleep(BEAT_EVERY_S)
        return None


async def _stop(task: asyncio.Task[None] | None) -> None:
    # Cancelled until it stops: a beat whose cancel its request's wait_for swallowed would
    # beat on, the leader (hearing it) would wait for this stage's report, and this stage
    # would wait here for the beat: both forever (CI, a member restarted under load).
    if task is not None:
        await cancel_all([task])
