"""`mooncake replay --from-db`: recorded arrivals (written by the recorder's own code into a
real, throwaway Postgres) re-run through the simulator under another policy."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from mooncake import events as ev
from mooncake.cli import app
from mooncake.commands.replay import ReplayError, ReplayOptions, run_replay
from mooncake.config import Settings
from mooncake.db.engine import async_engine
from mooncake.db.record import Incoming, record_events

pytestmark = pytest.mark.integration
T0 = datetime(2026, 3, 1, tzinfo=UTC)
HUGE = 150_000  # tokens: > 30 s of prefill alone on the reference hardware


def _tokens(n: int, prefix: int = 0) -> list[int]:
    return [(prefix * 7919 + i) % 32000 for i in range(n)]


def _history() -> list[ev.Event]:
    """Five arrivals a second apart: three completed under policy `none`, one rejected
    for TTFT, one (the huge prompt) admitted and still running; a duplicate submission."""
    es: list[ev.Event] = []
    for i, n in enumerate((2048, 2048, 3000, 1024)):
        rid, at = f"r{i}", T0 + timedelta(seconds=i)
        es.append(ev.RequestSubmitted(request_id=rid, token_ids=_tokens(n), occurred_at=at,
                                      params=ev.SamplingParams(max_tokens=16)))  # fmt: skip
        if i == 3:
            es.append(ev.RequestRejected(request_id=rid, reason=ev.RejectReason.TTFT_SLO,
                                         policy="early", occurred_at=at))  # fmt: skip
            continue
        es += [
            ev.RequestAdmitted(request_id=rid, policy="none", occurred_at=at),
            ev.PrefillStarted(request_id=rid, instance="p0", occurred_at=at),
            ev.RequestPrefilled(request_id=rid, instance="p0", prompt_tokens=n, occurred_at=at),
            ev.DecodeStarted(request_id=rid, instance="d0", occurred_at=at),
            ev.RequestCompleted(request_id=rid, output_tokens=16, ttft_s=0.5 + i, tbt_s=0.02,
                                occurred_at=at + timedelta(seconds=3)),
        ]  # fmt: skip
    big_at = T0 + timedelta(seconds=4)
    es.append(ev.RequestSubmitted(request_id="big", token_ids=_tokens(HUGE, 1), occurred_at=big_at))
    es.append(ev.RequestAdmitted(request_id="big", policy="none", occurred_at=big_at))
    # The same id again later: recorded, but not a second request.
    es.append(ev.RequestSubmitted(request_id="r0", token_ids=[1], occurred_at=big_at))
    return es


async def _record(url: str, events: list[ev.Event]) -> None:
    engine = async_engine(url)
    try:
        async with engine.begin() as conn:
            batch = [Incoming(e, "MC_REQ", i + 1, e.SUBJECT) for i, e in enumerate(events)]
            await record_events(conn, batch)
    finally:
        await engine.dispose()


@pytest.fixture
def recorded(settings: Settings) -> str:
    assert settings.database_url
    asyncio.run(_record(settings.database_url, _history()))
    return settings.database_url


def test_counterfactual_none_admits_what_early_rejected(recorded: str) -> None:
    res = run_replay(recorded, ReplayOptions(policy="none", prefill=1, decode=1))
    rec, cf = res["recorded"], res["counterfactual"]
    assert res["requests"] == 5  # the duplicate submission is not a request
    assert rec["rejected"] == 1 and rec["rejected_by_reason"] == {"ttft_slo": 1}
    assert rec["completed"] == 3 and rec["policies"] == {"none": 4, "early": 1}
    assert rec["ttft_s"]["p50"] == 1.5 and rec["tbt_s"]["p90"] == 0.02
    assert cf["policy"] == "none" and cf["rejected"] == 0 and cf["completed"] == 5
    assert res["changed"] == {"admitted_now_rejected": 0, "rejected_now_admitted": 1}
    assert cf["ttft_s"]["p99"] is not None and cf["ttft_s"]["p99"] > 30  # the huge prompt


def test_counterfactual_early_rejects_the_huge_prompt(recorded: str) -> None:
    res = run_replay(recorded, ReplayOptions(policy="early", prefill=1, decode=1))
    cf = res["counterfactual"]
    assert cf["rejected_by_reason"] == {"ttft_slo": 1} and cf["completed"] == 4
    # r3 (rejected live) is admitted by the simulated cluster; "big" (admitted live) is not.
    assert res["changed"] == {"admitted_now_rejected": 1, "rejected_now_admitted": 1}


def test_cli_prints_the_comparison(recorded: str) -> None:
    args = ["replay", "--from-db", "--policy", "early", "--database-url", recorded,
            "--prefill", "1", "--decode", "1"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "recorded" in res.output and "rejected: ttft_slo" in res.output
    res = CliRunner().invoke(app, [*args, "--json"])
    assert json.loads(res.stdout)["counterfactual"]["rejected"] == 1


def test_bad_input_is_one_line_and_exit_code_2(settings: Settings) -> None:
    assert settings.database_url  # truncated: an empty record
    with pytest.raises(ReplayError, match=r"no request\.submitted events"):
        run_replay(settings.database_url, ReplayOptions(policy="early"))
    runner = CliRunner()
    cases = [
        (["replay"], "--from-db"),
        (["replay", "--from-db", "--database-url", settings.database_url], "nothing to replay"),
        (["replay", "--from-db", "--policy", "fifo", "--database-url", settings.database_url],
         "unknown policy"),
        (["replay", "--from-db", "--database-url", "postgresql://x@127.0.0.1:1/none"],
         "cannot read the record"),
    ]  # fmt: skip
    for args, message in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and "Traceback" not in res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)
