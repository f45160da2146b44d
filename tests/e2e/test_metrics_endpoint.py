"""A real conductor process serves Prometheus `/metrics` that count what it handled, and
shuts down cleanly (exit 0) on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake import events as ev
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.publish import MSG_ID, Publisher
from mooncake.config import Settings
from mooncake.services import EmbeddedNats, free_port
from mooncake.work import LoadReport, WorkSubjects

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

STARTUP_TIMEOUT_S = 60.0
COUNT_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 15.0


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            if resp.status != 200:
                return None
            return str(resp.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _start_conductor(env: dict[str, str], cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "mooncake.cli", "worker", "conductor", "--instance", "c0"],
            cwd=cwd,  # no .env / runtime.env of the checkout
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


async def _wait_for_scrape(proc: subprocess.Popen[bytes], port: int, log: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"worker exited {proc.returncode} while starting:\n{_read(log)}")
        text = await asyncio.to_thread(_scrape, port)
        if text is not None:
            return text
        await asyncio.sleep(0.1)
    pytest.fail(f"/metrics on :{port} never answered:\n{_read(log)}")


async def _fake_instances(settings: Settings) -> None:
    """A prefill and a decode instance as the Conductor sees them (their load reports):
    with none, it would rightly reject the request with no_instance."""
    nc = await connect(settings, "fake-instances")
    subjects = WorkSubjects(ev.Namespace(settings.namespace))
    try:
        for seq in range(1, 1_000_000):
            for iid, role in (("p0", "prefill"), ("d0", "decode")):
                r = LoadReport(instance=iid, role=role, node=iid, seq=seq, at=time.time())
                await nc.publish(subjects.load(iid), r.to_json())
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def test_conductor_metrics_and_clean_shutdown(tmp_path: Path) -> None:
    nats = EmbeddedNats.create(tmp_path).start()
    namespace = "mx" + uuid.uuid4().hex[:10]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env |= {
        "MOONCAKE_NATS_URL": nats.url,
        "MOONCAKE_NAMESPACE": namespace,
        "MOONCAKE_METRICS_PORT": str(port),
        "MOONCAKE_METRICS_HOST": "127.0.0.1",
    }
    log_path = tmp_path / "conductor.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = _start_conductor(env, tmp_path, log_path)
        await _wait_for_scrape(proc, port, log_path)

        settings = Settings(nats_url=nats.url, namespace=namespace, otlp_endpoint=None)
        ns = ev.Namespace(namespace)
        instances = asyncio.create_task(_fake_instances(settings))
        nc = await connect(settings, "metrics-test")
        try:
            js = nc.jetstream()
            await ensure_streams(js, settings)
            publisher = Publisher(nc, js, ns)
            subject = ns.of(ev.RequestSubmitted)
            await publisher.publish(ev.RequestSubmitted(request_id="ok-1", prompt="hello"))
            # Invalid (no prompt, no token ids) but with a readable request id: rejected.
            await publisher.publish_raw(
                subject,
                b'{"type": "request.submitted", "request_id": "bad-1"}',
                {MSG_ID: uuid.uuid4().hex},
            )
            # Unreadable: nobody to answer, dead-lettered.
            await publisher.publish_raw(subject, b"not json at all", {MSG_ID: uuid.uuid4().hex})
        finally:
            await nc.drain()

        expected = {
            ("mc_bus_messages_total", (("consumer", "conductor"), ("outcome", "ack"))): 2.0,
            ("mc_bus_messages_total", (("consumer", "conductor"), ("outcome", "dead_letter"))): 1.0,
            ("mc_requests_admitted_total", (("policy", "early"),)): 1.0,  # the default
            (
                "mc_requests_rejected_total",
                (("stage", "ingress"), ("reason", "invalid_request")),
            ): 1.0,
            (
                "mc_dead_letters_total",
                (("consumer", "conductor"), ("reason", "invalid_request")),
            ): 1.0,
        }
        deadline = time.monotonic() + COUNT_TIMEOUT_S
        while True:
            text = await asyncio.to_thread(_scrape, port) or ""
            samples = _samples(text)
            got = {key: _value(samples, key[0], **dict(key[1])) for key in expected}
            if got == expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        instances.cancel()
        assert got == expected, f"{got}\n--- exposition ---\n{text}\n--- log ---\n{_read(log_path)}"
        assert 'mc_bus_messages_total{consumer="conductor"' in text
        assert "mc_requests_admitted_total" in text
        assert _value(samples, "mc_bus_handle_seconds_count", consumer="conductor") >= 1

        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within {SHUTDOWN_TIMEOUT_S}s of SIGTERM:\n{_read(log_path)}")
        assert code == 0, f"exit {code} after SIGTERM:\n{_read(log_path)}"
        assert "conductor c0 stopped" in _read(log_path)  # the shutdown path ran to its end
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        nats.stop()
