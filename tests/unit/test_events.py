"""The event registry and ingress parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake import events as ev


def test_registry_is_one_to_one_and_every_subject_is_in_a_stream() -> None:
    types = [ev._type_of(c) for c in ev.EVENT_CLASSES]
    subjects = [c.SUBJECT for c in ev.EVENT_CLASSES]
    assert len(set(types)) == len(types)
    assert len(set(subjects)) == len(subjects)
    for subject in subjects:
        prefixes = [p[:-1] for s in ev.STREAMS for p in s.subjects]
        assert any(subject.startswith(p) for p in prefixes), subject
    assert ev.TYPE_TO_SUBJECT[ev.SUBJECT_TO_TYPE["mc.req.submitted"]] == "mc.req.submitted"


def _sample_events() -> list[ev.Event]:
    return [
        ev.RequestSubmitted(request_id="r1", prompt="hello", params=ev.SamplingParams(seed=3)),
        ev.RequestSubmitted(request_id="r2", token_ids=[1, 2, 3], reply_to="_INBOX.x"),
        ev.RequestAdmitted(request_id="r1", policy="none", inputs={"a": 1}),
        ev.RequestRejected(request_id="r1", reason=ev.RejectReason.TTFT_SLO, detail="slow"),
        ev.PrefillStarted(request_id="r1", instance="p0"),
        ev.RequestPrefilled(request_id="r1", instance="p0", prompt_tokens=10, kv_keys=["k"]),
        ev.DecodeStarted(request_id="r1", instance="d0"),
        ev.DecodePreempted(request_id="r1", instance="d0", output_tokens=3, context_tokens=40),
        ev.DecodeResumed(request_id="r1", instance="d0", reloaded_tokens=32, waited_s=0.5),
        ev.DecodeStopped(request_id="r1", instance="d0", reason="client", output_tokens=3),
        ev.TokensNotStored(request_id="r1", instance="d0", first_index=1, last_index=4),
        ev.RequestCompleted(request_id="r1", output_tokens=4, ttft_s=0.1, tbt_s=0.02),
        ev.RequestFailed(request_id="r1", reason="worker_lost"),
        ev.CancelRequested(request_id="r1"),
        ev.RequestCancelled(request_id="r1"),
        ev.KvObjectStored(key="k", size_bytes=5, replicas=[ev.Replica(node="n0", segment="s")]),
        ev.KvObjectRemoved(key="k"),
        ev.InstanceRegistered(instance_id="p0", role="prefill"),
        ev.InstanceDeregistered(instance_id="p0"),
    ]


def test_every_event_type_round_trips_through_json() -> None:
    samples = _sample_events()
    assert {type(e) for e in samples} == set(ev.EVENT_CLASSES)
    for e in samples:
        back = ev.parse_event(e.to_json(), subject=e.SUBJECT)
        assert back == e
        assert ev.event_from_payload(e.model_dump(mode="json")) == e


def test_events_are_frozen() -> None:
    e = ev.RequestSubmitted(request_id="r", prompt="p")
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error
        e.request_id = "other"  # type: ignore[misc]


BAD = [
    (b"not json at all", None),
    (b'{"type":"request.exploded","request_id":"r-1"}', "r-1"),
    (b'{"type":"request.submitted","prompt":"hi"}', None),  # no request id
    (b'{"type":"request.submitted","request_id":"r-2"}', "r-2"),  # no prompt
    (b'{"type":"request.submitted","request_id":"r-3","prompt":"x","token_ids":[1]}', "r-3"),
    (b'{"type":"request.submitted","request_id":"r-4","prompt":5}', "r-4"),
    (
        b'{"type":"request.submitted","request_id":"r-5","prompt":"x","params":{"max_tokens":-1}}',
        "r-5",
    ),
    (b'{"type":"request.submitted","request_id":"r-6","prompt":"x","surprise":1}', "r-6"),
    (b'{"type":"request.submitted","request_id":"bad id with spaces","prompt":"x"}', None),
    (b"\xff\xfe\x00garbage", None),
    (b"[]", None),
    # Nested deeper than Python's stack: the lone-surrogate check's json.loads overflowed it.
    (
        b'{"type":"request.submitted","request_id":"r-7","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
        "r-7",
    ),
    # A seed no generator takes (torch's manual_seed overflows): the prefill would fail on it.
    (
        b'{"type":"request.submitted","request_id":"r-8","prompt":"x","params":'
        b'{"temperature":1,"seed":18446744073709551616}}',
        "r-8",
    ),
]


@pytest.mark.parametrize(("data", "request_id"), BAD)
def test_bad_messages_become_invalid_events_never_exceptions(
    data: bytes, request_id: str | None
) -> None:
    parsed = ev.parse_event(data, subject="mc.req.submitted")
    assert isinstance(parsed, ev.InvalidEvent)
    assert parsed.reason == "invalid_request"
    assert parsed.detail
    assert parsed.request_id == request_id


def test_oversize_payload_is_refused_before_parsing_with_the_request_id() -> None:
    body = {"type": "request.submitted", "request_id": "big-1", "prompt": "x" * (2 << 20)}
    parsed = ev.parse_event(json.dumps(body).encode(), max_bytes=1 << 20)
    assert isinstance(parsed, ev.InvalidEvent)
    assert parsed.reason == "payload_too_large"
    assert parsed.request_id == "big-1"


def test_a_valid_event_on_the_wrong_subject_is_refused() -> None:
    admitted = ev.RequestAdmitted(request_id="r", policy="none")
    parsed = ev.parse_event(admitted.to_json(), subject="mc.req.submitted")
    assert isinstance(parsed, ev.InvalidEvent)
    assert parsed.request_id == "r"


def test_derived_event_ids_are_deterministic_and_distinct() -> None:
    a = ev.derived_event_id("e1", "admitted")
    assert a == ev.derived_event_id("e1", "admitted")
    assert a != ev.derived_event_id("e1", "rejected")
    assert a != ev.derived_event_id("e2", "admitted")


@given(st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True))
def test_namespaces_map_subjects_and_streams_and_back(prefix: str) -> None:
    ns = ev.Namespace(prefix)
    for cls in ev.EVENT_CLASSES:
        subject = ns.of(cls)
        assert subject.startswith(prefix + ".")
        assert ns.canonical(subject) == cls.SUBJECT
    names = [s.name for s in ns.streams()]
    assert len(set(names)) == len(names)
    assert all(n.startswith(prefix.upper() + "_") for n in names)


@given(st.binary(max_size=2000))
def test_parse_event_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    parsed = ev.parse_event(data, subject="mc.req.submitted", max_bytes=1000)
    assert isinstance(parsed, ev.InvalidEvent | ev.Event)


def test_an_event_with_u0000_is_made_storable_and_others_are_left_alone() -> None:
    """Postgres keeps no U+0000 (jsonb or text): the recorder stores U+FFFD in its place,
    in values and keys, and nothing else changes (an escaped backslash before "u0000" is
    text, not the character)."""
    from mooncake.db.record import NUL_ON_THE_WIRE, storable

    req = ev.RequestSubmitted(
        request_id="r1",
        token_ids=[1],
        params=ev.SamplingParams(stop=["a\x00b", "\\u0000"]),
        reply_to="inbox.r1",
    )
    assert NUL_ON_THE_WIRE in req.to_json()
    kept = storable(req)
    assert isinstance(kept, ev.RequestSubmitted)
    assert kept.params.stop == ["a\ufffdb", "\\u0000"]
    assert kept.model_copy(update={"params": req.params}) == req
    rejected = ev.RequestRejected(
        request_id="r1", reason=ev.RejectReason.INVALID_REQUEST, stage="admission",
        detail="unknown field 'x\x00'", inputs={"k\x00": "v\x00"},
    )  # fmt: skip
    assert storable(rejected).inputs == {"k\ufffd": "v\ufffd"}
    assert storable(rejected).detail == "unknown field 'x\ufffd'"
    plain = ev.RequestSubmitted(request_id="r2", token_ids=[1], params={"stop": ["\\u0000"]})
    assert NUL_ON_THE_WIRE in plain.to_json()  # a false alarm on the wire check ...
    assert storable(plain) is plain  # ... that changes nothing


def test_an_unreadable_submission_keeps_what_lets_its_client_hear_back() -> None:
    """Its request id and a literal reply_to are sniffed; a lone surrogate is named as such
    (pydantic's own message is "unexpected end of hex escape")."""
    base = b'{"type":"request.submitted","event_id":"e","request_id":"r-1",'
    bad = ev.parse_event(base + b'"prompt":"a\\ud800b","reply_to":"_INBOX.abc"}')
    assert isinstance(bad, ev.InvalidEvent)
    assert (bad.request_id, bad.reply_to) == ("r-1", "_INBOX.abc")
    assert bad.detail.startswith("prompt: a string holds a lone UTF-16 surrogate")
    wild = ev.parse_event(base + b'"prompt":"x","reply_to":"a.*","params":{"max_tokens":0}}')
    assert isinstance(wild, ev.InvalidEvent) and wild.reply_to is None  # never a wildcard
    assert "max_tokens" in wild.detail
    assert ev.unencodable({"a": ["ok", {"\ud800": 1}]}) == "a.1.\ud800"
    pair = json.loads('"\\ud83d\\ude00"')  # JSON joins a surrogate pair into one character
    assert ev.unencodable({"a": ["ok", pair]}) is None
