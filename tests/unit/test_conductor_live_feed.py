"""Load reports -> ClusterView facts, liveness, lifecycle events -> facts, cancel stages."""

from __future__ import annotations

from mooncake import events as ev
from mooncake.core import cluster as cl
from mooncake.serving.conductor_feed import Liveness, lifecycle_fact
from mooncake.serving.conductor_terminal import Known, KnownRequests, cancel_stage
from mooncake.work import LoadReport


def report(iid: str, role: str, node: str, seq: int = 1, **kw: int) -> LoadReport:
    return LoadReport(instance=iid, role=role, node=node, seq=seq, at=0.0, **kw)


def test_first_report_joins_later_ones_only_refresh() -> None:
    live = Liveness(timeout_s=2.0)
    assert live.report(report("p1", "prefill", "n1"), 0.0) == [
        cl.InstanceJoined("p1", "prefill", "n1", None)
    ]
    assert live.report(report("p1", "prefill", "n1", seq=2), 0.5) == []
    assert live.alive("prefill") == ["p1"] and live.alive("decode") == []


def test_decode_reports_correct_the_batch() -> None:
    live = Liveness(timeout_s=2.0)
    first = live.report(
        report("d1", "decode", "n2", running=3, context_tokens=900, kv_capacity_tokens=4096), 0.0
    )
    assert first == [
        cl.InstanceJoined("d1", "decode", "n2", 4096),
        cl.DecodeLoadReported("d1", 3, 900, 4096),
    ]
    assert live.report(report("d1", "decode", "n2", 2, running=1), 1.0) == [
        cl.DecodeLoadReported("d1", 1, 0)
    ]


def test_a_decode_report_moves_the_capacity_the_view_fits_against() -> None:
    v = cl.ClusterView()
    v.apply(cl.InstanceJoined("d1", "decode", "n2", 4096), 0.0)
    assert v.decode["d1"].fits(4096) and not v.decode["d1"].fits(4097)
    v.apply(cl.DecodeLoadReported("d1", 1, 1000, 2048), 0.0)  # its pool as it reports it
    assert v.decode["d1"].kv_capacity_tokens == 2048
    assert v.decode["d1"].fits(1048) and not v.decode["d1"].fits(1049)
    v.apply(cl.DecodeLoadReported("d1", 1, 1000), 0.0)  # no capacity said: the view keeps it
    assert v.decode["d1"].kv_capacity_tokens == 2048


def test_silence_past_the_timeout_is_death_and_the_node_goes_with_the_last_instance() -> None:
    live = Liveness(timeout_s=2.0)
    live.report(report("p1", "prefill", "n1"), 0.0)
    live.report(report("d1", "decode", "n1"), 0.0)  # same node
    live.report(report("p2", "prefill", "n2"), 0.0)
    assert live.expire(2.0) == []  # exactly the timeout: still alive
    live.report(report("d1", "decode", "n1", 2), 1.5)
    dead = live.expire(2.5)
    assert [(m.instance, f) for m, f in dead] == [
        ("p1", [cl.InstanceLeft("p1")]),  # d1 still lives on n1: its blocks stay
        ("p2", [cl.InstanceLeft("p2"), cl.NodeLost("n2")]),
    ]
    [(m, facts)] = live.expire(10.0)
    assert m.instance == "d1" and facts == [cl.InstanceLeft("d1"), cl.NodeLost("n1")]
    assert live.members == {}
    # A dead instance that reports again joins again.
    assert live.report(report("p1", "prefill", "n1", 9), 11.0) == [
        cl.InstanceJoined("p1", "prefill", "n1", None)
    ]


def test_an_id_back_with_another_role_leaves_then_joins() -> None:
    live = Liveness(timeout_s=2.0)
    live.report(report("x", "prefill", "n1"), 0.0)
    facts = live.report(report("x", "decode", "n1"), 1.0)
    assert facts[:3] == [
        cl.InstanceLeft("x"),
        cl.NodeLost("n1"),
        cl.InstanceJoined("x", "decode", "n1", None),
    ]


def test_lifecycle_events_become_facts() -> None:
    rid = "r1"
    cases = [
        (ev.PrefillStarted(request_id=rid, instance="p1"), cl.PrefillStarted(rid)),
        (
            ev.RequestPrefilled(request_id=rid, instance="p1", prompt_tokens=3),
            cl.PrefillFinished(rid, 3, 0, None),  # no time reported: no cost sample
        ),
        (
            ev.RequestPrefilled(
                request_id=rid, instance="p1", prompt_tokens=300, cached_tokens=128, prefill_s=0.25
            ),
            cl.PrefillFinished(rid, 300, 128, 0.25),
        ),
        (  # a CPP group's time prices no one instance: no cost sample
            ev.RequestPrefilled(
                request_id=rid,
                instance="p1",
                prompt_tokens=300,
                prefill_s=0.25,
                stages=["p1", "p2"],
            ),
            cl.PrefillFinished(rid, 300, 0, None),
        ),
        (  # nor a group's given up, then one instance's
            ev.RequestPrefilled(
                request_id=rid,
                instance="p1",
                prompt_tokens=300,
                prefill_s=0.25,
                cpp_fallback="p2 went silent",
            ),
            cl.PrefillFinished(rid, 300, 0, None),
        ),
        (ev.DecodeStarted(request_id=rid, instance="d1"), cl.DecodeStarted(rid)),
        (ev.RequestCompleted(request_id=rid, output_tokens=4), cl.DecodeFinished(rid, 4)),
        (ev.RequestFailed(request_id=rid, reason="x"), cl.RequestDropped(rid)),
        (ev.RequestCancelled(request_id=rid), cl.RequestDropped(rid)),
        (
            ev.RequestRejected(request_id=rid, reason=ev.RejectReason.DECODE_OVERLOADED),
            cl.RequestDropped(rid),
        ),
        (ev.RequestSubmitted(request_id=rid, token_ids=[1]), None),
    ]
    for event, fact in cases:
        assert lifecycle_fact(event) == fact, event.type


def test_cancel_stage_follows_the_view() -> None:
    view = cl.ClusterView()
    view.apply(cl.InstanceJoined("p1", "prefill"), 0.0)
    view.apply(cl.InstanceJoined("d1", "decode"), 0.0)
    view.apply(cl.Assigned("r1", "p1", "d1", 100, 0.5, 0.5), 0.0)
    assert cancel_stage(view, "r1", True) == "prefill"
    view.apply(cl.PrefillFinished("r1"), 1.0)
    assert cancel_stage(view, "r1", True) == "decode"
    assert cancel_stage(view, "gone", True) == "unknown"
    assert cancel_stage(view, "never-seen", False) == "admission"


def test_known_requests_are_bounded() -> None:
    known = KnownRequests(capacity=2)
    for i in range(3):
        known.add(f"r{i}", Known(f"inbox.{i}", f"e{i}"))
    assert len(known) == 2 and known.get("r0") is None and known.get("r2") == Known("inbox.2", "e2")


def test_the_fit_uses_the_free_pages_a_decode_instance_reports() -> None:
    """Free KV as the pool reports it (a prefix shared by several sequences held once);
    between reports it follows requests starting and ending; admitted requests still in
    prefill are counted against it."""
    live, v = Liveness(timeout_s=2.0), cl.ClusterView()
    r = report("d1", "decode", "n2", running=2, context_tokens=3000, kv_capacity_tokens=4096,
               kv_free_tokens=2500)  # fmt: skip
    for f in live.report(r, 0.0):
        v.apply(f, 0.0)
    d = v.decode["d1"]
    assert d.kv_free_tokens == 2500 and d.kv_room() == 2500
    assert d.fits(2500) and not d.fits(2501)  # not capacity - context (1096): pages shared
    v.apply(cl.InstanceJoined("p1", "prefill", "n1"), 0.0)
    v.apply(cl.Assigned("r1", "p1", "d1", 1000, 0.1, 0.1), 0.0)
    assert d.fits(1500) and not d.fits(1501)  # r1's 1000 reserved
    v.apply(cl.DecodeStarted("r1"), 0.5)
    assert d.kv_free_tokens == 1500 and d.fits(1500) and not d.fits(1501)
    v.apply(cl.DecodeFinished("r1"), 0.9)
    assert d.kv_free_tokens == 2500


def test_a_full_decode_pool_delays_a_request_it_does_not_turn_it_away() -> None:
    """With no decode instance that has room now, Algorithm 1 routes to one whose pool can
    hold the prompt at all (it queues the work, and preempts rather than fails); a prompt
    no decode pool can ever hold finds no instance."""
    from mooncake.core.conductor import ConductorConfig, ScheduleRequest, choose
    from mooncake.core.cost_model import reference_costs

    v = cl.ClusterView()
    v.apply(cl.InstanceJoined("p1", "prefill", "n1"), 0.0)
    for did, free in (("d1", 100), ("d2", 300)):
        v.apply(cl.InstanceJoined(did, "decode", did, 4096), 0.0)
        v.apply(cl.DecodeLoadReported(did, 1, 3000, 4096, free), 0.0)
    costs, cfg = reference_costs(), ConductorConfig(block_tokens=16)
    fits = choose(v, ScheduleRequest("a", 200, ()), cfg, costs, 0.0)
    assert fits is not None and fits.decode.id == "d2"  # the one with room
    full = choose(v, ScheduleRequest("b", 1000, ()), cfg, costs, 0.0)
    assert full is not None and full.decode.id in ("d1", "d2")  # queued there
    assert choose(v, ScheduleRequest("c", 5000, ()), cfg, costs, 0.0) is None


def test_a_decode_report_carries_its_steps_to_the_view() -> None:
    live = Liveness(timeout_s=2.0)
    r = report("d1", "decode", "n1").model_copy(
        update={"running": 3, "context_tokens": 900, "steps": 40, "step_s": 0.05,
                "step_batch": 2.5, "step_context_tokens": 800.0}
    )  # fmt: skip
    facts = live.report(r, 0.0)
    assert facts[-1] == cl.DecodeLoadReported("d1", 3, 900, None, None, 40, 0.05, 2.5, 800.0)


def test_an_instances_engine_timings_are_passed_on_once() -> None:
    from mooncake.work import EngineTiming

    live = Liveness(timeout_s=2.0)
    timed = [EngineTiming(x=64, z=0, seconds=0.1), EngineTiming(x=512, z=0, seconds=0.9)]
    first = live.report(report("p1", "prefill", "n1"), 0.0)  # before its calibration ended
    assert not any(isinstance(f, cl.EngineCalibrated) for f in first)
    r = report("p1", "prefill", "n1", 2).model_copy(update={"calibration": timed})
    assert live.report(r, 0.5) == [
        cl.EngineCalibrated("p1", "prefill", ((64.0, 0.0, 0.1), (512.0, 0.0, 0.9)))
    ]
    assert live.report(r.model_copy(update={"seq": 3}), 1.0) == []  # already passed on
    # A Conductor that starts later hears it with the instance's first report.
    later = Liveness(timeout_s=2.0).report(r, 0.0)
    assert cl.EngineCalibrated("p1", "prefill", ((64.0, 0.0, 0.1), (512.0, 0.0, 0.9))) in later
