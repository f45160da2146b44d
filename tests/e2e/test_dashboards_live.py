"""The dashboards answer from a running system (issue 43): `up`'s stack with metrics on,
scraped by a real Prometheus (Debian's; `.ci/run` installs it) with `dashboards/
prometheus.yml`'s own job, some requests sent, then every Grafana panel's expression queried
through Prometheus's HTTP API and every alert rule evaluated by Prometheus itself.

Each panel returns a series, or is in `ONLY_UNDER` with the reason it shows only under a
fault or a load this test does not make. Each alert rule is loaded and evaluates without an
error (none fires on a healthy stack: that is their point). `promtool check config` and
`check rules` pass on the files as they are shipped. Grafana itself does not install here:
no screenshot of a panel is taken.

The scrape job is the shipped one with its targets replaced by the stack's endpoints, and one
relabel rule added after its own: in docker compose a target's host is its service name,
which the shipped rule makes the `instance`; here every worker is 127.0.0.1, so the
instance comes from a label naming it instead."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from _faults_harness import FaultStack, connect, running

from mooncake import events as ev
from mooncake.client import ask
from mooncake.config import EngineSettings, GatewaySettings, Settings
from mooncake.services import free_port

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                       reason="Debian's prometheus is not installed (.ci/run installs it)"),
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RATE_INTERVAL = "30s"  # Grafana's $__rate_interval at a 1 s scrape

# (dashboard, panel title, metric) -> why that query has no series on a healthy stack serving
# a few requests: its labelled series exist only once what they count has happened.
ONLY_UNDER: dict[tuple[str, str, str], str] = {
    (
        "mooncake-kvcache",
        "Decode KV recomputed",
        "mc_decode_kv_recomputed_total",
    ): "decode work whose prompt KV was missing from the store (lost, evicted)",
    (
        "mooncake-kvcache",
        "Tier moves and objects",
        "mc_store_moves_total",
    ): "a node moving objects between DRAM and SSD (offload when DRAM fills, promotion)",
    (
        "mooncake-pipeline",
        "Dead letters",
        "mc_dead_letters_total",
    ): "a message given up (invalid, or past bus.max_deliver)",
    (
        "mooncake-pipeline",
        "Publishes and retries",
        "mc_bus_publish_retries_total",
    ): "a publish that timed out or was cut off (a broker restart or outage)",
    (
        "mooncake-pipeline",
        "Instances declared dead",
        "mc_instances_declared_dead_total",
    ): "a worker that stops reporting (killed, hung)",
    (
        "mooncake-pipeline",
        "Work re-dispatched",
        "mc_work_redispatched_total",
    ): "a dead instance's work handed to a live one",
    (
        "mooncake-requests",
        "Admissions and rejections",
        "mc_requests_rejected_total",
    ): "a request rejected (overload, a quota, bad input)",
    (
        "mooncake-requests",
        "Rejections by reason",
        "mc_requests_rejected_total",
    ): "a request rejected (overload, a quota, bad input)",
    (
        "mooncake-requests",
        "Failures and cancellations by reason",
        "mc_requests_ended_total",
    ): "a request failed or cancelled",
    (
        "mooncake-requests",
        "Failures and cancellations by reason",
        "mc_conductor_terminal_total",
    ): "a request the Conductor failed or cancelled",
}


def _panels() -> Iterator[tuple[str, str, str]]:
    """(dashboard, panel title, expression) of every panel target."""
    for path in sorted((DASHBOARDS / "grafana" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board.get("panels", []):
            for target in panel.get("targets", []):
                if "expr" in target:
                    yield path.stem, panel.get("title", ""), target["expr"]


def _config(stack: FaultStack, rules: Path) -> dict[str, Any]:
    shipped = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "mooncake")
    job["static_configs"] = [
        {
            "targets": [urllib.parse.urlsplit(w.metrics_url).netloc],
            "labels": {"role": w.role, "service": w.name},
        }
        for w in stack.workers
        if w.metrics_url
    ]
    job["relabel_configs"].append({"source_labels": ["service"], "target_label": "instance"})
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [job],
    }


def _get(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest_asyncio.fixture
async def stack() -> AsyncIterator[FaultStack]:
    path = Path(tempfile.mkdtemp(prefix="mc-dash-"))
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}",  # nothing there: the stack starts its own
        database_url=None, namespace="mc", data_dir=path,
        engine=EngineSettings(model="dummy"), gateway=GatewaySettings(port=0),
    )  # fmt: skip
    async with running(FaultStack(settings, metrics=True)) as s:
        yield s


def test_the_shipped_files_pass_promtool() -> None:
    assert PROMTOOL is not None
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        out = subprocess.run([PROMTOOL, *args], cwd=DASHBOARDS, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


async def test_every_panel_and_alert_answers_from_a_running_stack(
    stack: FaultStack, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    ns = ev.Namespace(stack.settings.namespace)
    nc = await connect(stack.nats_url)
    try:
        # The stack is up once it answers.
        deadline = time.monotonic() + 120
        while True:
            out = await ask(nc, token_ids=[1, 2, 3], ns=ns,
                            params=ev.SamplingParams(max_tokens=2), timeout_s=10)  # fmt: skip
            if out.finished or time.monotonic() > deadline:
                break
        assert out.finished, "the stack did not answer in 120 s"

        rules = tmp_path / "alerts.yml"
        shutil.copy(DASHBOARDS / "alerts.yml", rules)
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(_config(stack, rules)))
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        argv = [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        prom = await asyncio.to_thread(subprocess.Popen, argv, stdout=log,
                                       stderr=subprocess.STDOUT)  # fmt: skip
        try:
            # Traffic while it scrapes: a prompt twice (the second hits its cached prefix), a
            # few others; then idle scrapes so that every rate has two points.
            prompt = [(7 * k) % 1000 for k in range(200)]
            for i in range(6):
                tokens = prompt if i < 2 else [(i * 31 + k) % 1000 for k in range(60 + 20 * i)]
                done = await ask(nc, token_ids=tokens, ns=ns,
                                 params=ev.SamplingParams(max_tokens=8), timeout_s=60)  # fmt: skip
                assert done.finished, (i, done.finish_reason, done.error)
            await asyncio.sleep(8)
            targets = await asyncio.to_thread(_get, port, "/api/v1/targets")
            down = [t["labels"] for t in targets["activeTargets"] if t["health"] != "up"]
            assert not down and targets["activeTargets"], targets
            empty = []
            for board, title, expr in _panels():
                query = expr.replace("$__rate_interval", RATE_INTERVAL)
                data = await asyncio.to_thread(_get, port, "/api/v1/query", query=query)
                if not data["result"]:
                    empty.append((board, title, expr))
            unexplained = [
                e for e in empty
                if not any(b == e[0] and t == e[1] and m in e[2] for b, t, m in ONLY_UNDER)
            ]  # fmt: skip
            assert not unexplained, json.dumps(unexplained, indent=1)
            print(f"{len(empty)} of {len(list(_panels()))} panel queries empty, each explained")
            groups = (await asyncio.to_thread(_get, port, "/api/v1/rules"))["groups"]
            alerts = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
            shipped = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
            assert len(alerts) == sum(len(g["rules"]) for g in shipped["groups"]), alerts
            bad = [(r["name"], r.get("lastError")) for r in alerts if r["health"] != "ok"]
            assert not bad, bad
            firing = [r["name"] for r in alerts if r["state"] == "firing"]
            assert not firing, firing  # a healthy stack raises none
        finally:
            prom.terminate()
            prom.wait(15)
            log.close()
    finally:
        await nc.drain()
