"""The Grafana dashboards, the alert rules and the code's metrics registry agree.

Every metric name a dashboard panel or an alert rule queries must be one that
`mooncake.metrics` defines and the process registry serves (with the suffixes the exposition
format adds: `_total` of counters, `_bucket`/`_sum`/`_count` of histograms, `_created`).
A renamed or removed metric otherwise leaves a panel silently empty and an alert that can
never fire. This check needs no Prometheus, so PromQL is read by a small tokenizer that
knows PromQL's functions, aggregations and keywords and skips strings, label matchers,
range selectors, grouping clauses and Grafana's `$variables`; promtool and a real Prometheus
scraping a running stack are tests/e2e/test_dashboards_live.py's.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from mooncake import metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
GRAFANA = DASHBOARDS / "grafana"
DASHBOARD_JSON = sorted((GRAFANA / "dashboards").glob("*.json"))
ALERTS = DASHBOARDS / "alerts.yml"

# --- a small PromQL reader -------------------------------------------------------------------

AGGREGATIONS = frozenset(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile "
    "limitk limit_ratio".split()
)
FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv double_exponential_smoothing exp floor histogram_avg
    histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
    histogram_sum holt_winters hour idelta increase irate label_join label_replace last_over_time
    ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
    present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year start end""".split()
)
KEYWORDS = frozenset("and or unless bool offset inf nan atan2".split())
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)"
# Bare group_left / group_right (no label list) are keywords too.
BARE_GROUPING = frozenset({"group_left", "group_right", "by", "without", "on", "ignoring"})

TOKEN = re.compile(
    r"""(?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      |(?P<other>\S)""",
    re.VERBOSE,
)


def _strip(expr: str) -> str:
    """The expression without what cannot name a metric: strings, comments, Grafana
    variables, label matchers, range/subquery selectors, grouping clauses, offsets."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", expr)
    expr = re.sub(r"#[^\n]*", " ", expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", " ", expr)
    expr = re.sub(r"\{[^{}]*\}", " ", expr)
    expr = re.sub(r"\[[^\[\]]*\]", " ", expr)
    expr = re.sub(GROUPING, " ", expr)
    expr = re.sub(r"\boffset\s+-?\w+", " ", expr)
    return re.sub(r"@\s*[\d.]+", " ", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. Raises ValueError on a call of a
    function PromQL does not have (a typo there would hide a metric name)."""
    text = _strip(expr)
    names: set[str] = set()
    tokens = [(m.lastgroup, m.group(), m.end()) for m in TOKEN.finditer(text)]
    for i, (kind, value, _end) in enumerate(tokens):
        if kind != "ident":
            continue
        called = i + 1 < len(tokens) and tokens[i + 1][1] == "("
        if value in AGGREGATIONS or value in KEYWORDS or value in BARE_GROUPING:
            continue
        if called:
            if value not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {value!r} in {expr!r}")
            continue
        names.add(value)
    return names


# --- what the code exports -------------------------------------------------------------------

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def exposed(families: Any) -> set[str]:
    """Series names a scrape shows for these metric families (labelled metrics with no
    child yet show no samples, so the names come from each family's type)."""
    out: set[str] = set()
    for family in families:
        out.update(family.name + s for s in SUFFIXES[family.type])
        out.update(s.name for s in family.samples)
    return out


def defined_in_metrics_module() -> set[str]:
    """Series names of every metric `mooncake.metrics` defines."""
    objs = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    return exposed(f for m in objs for f in m.describe())


def served_by_registry() -> set[str]:
    return exposed(REGISTRY.collect())


def exported() -> set[str]:
    """A dashboard may use what the single registry module defines and the process serves."""
    return defined_in_metrics_module() & served_by_registry()


def missing(exprs: list[str], known: set[str]) -> dict[str, set[str]]:
    """Expression -> names it queries that are not exported (only the failing ones)."""
    out = {e: metric_names(e) - known for e in exprs}
    return {e: names for e, names in out.items() if names}


# --- the dashboards --------------------------------------------------------------------------


def load_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels (collapsed rows keep theirs inside) included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def provisioned_datasources() -> dict[str, str]:
    doc = yaml.safe_load((GRAFANA / "provisioning/datasources/datasources.yml").read_text())
    return {d["uid"]: d["type"] for d in doc["datasources"]}


def load_alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


# --- the tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ("rate(mc_a_total[5m])", {"mc_a_total"}),
        (
            'histogram_quantile(0.9, sum by (le) (rate(mc_h_bucket{job="x"}[$__rate_interval])))',
            {"mc_h_bucket"},
        ),
        ("sum(rate(a_total[1m])) by (instance) / on() group_left() sum(b)", {"a_total", "b"}),
        ('label_replace(rate(x_total[1m]), "type", "rate(y)", "", "")', {"x_total"}),
        ("a > bool 1e3 and b offset 5m unless c @ 1700000000", {"a", "b", "c"}),
        ("max without (instance, role) (job:mc_rate:sum5m) * -1.5e-3", {"job:mc_rate:sum5m"}),
        ("sum_over_time(a[10m:1m]) or vector(0)", {"a"}),
        ('max(mc_slo_seconds{slo="ttft", le=~"1|2"}) + ${offset_var}', {"mc_slo_seconds"}),
        ("avg(x) by (le, tier) and on (tier) group_right y", {"x", "y"}),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_an_unknown_function_is_an_error_not_a_metric() -> None:
    with pytest.raises(ValueError, match="histgram_quantile"):
        metric_names("histgram_quantile(0.9, rate(a_bucket[5m]))")


def test_the_exported_names_carry_the_exposition_suffixes() -> None:
    names = exported()
    assert {"mc_request_ttft_seconds_bucket", "mc_request_ttft_seconds_count"} <= names
    assert {"mc_request_ttft_seconds_sum", "mc_requests_rejected_total"} <= names
    assert "mc_recorder_lag_seconds" in names
    # Labelled metrics that nothing has touched yet are exported by name all the same.
    assert "mc_prefill_kv_tokens_total" in names
    # Not a name prometheus_client would expose for a counter or a histogram.
    assert "mc_requests_rejected" not in names and "mc_request_ttft_seconds" not in names


def test_every_metric_of_the_module_is_served_by_the_process_registry() -> None:
    assert defined_in_metrics_module() <= served_by_registry()


# --- the check itself can fail -------------------------------------------------------------


def test_a_made_up_metric_is_reported() -> None:
    known = exported()
    exprs = [
        "sum(rate(mc_requests_rejected_total[5m]))",
        'histogram_quantile(0.9, sum by (le) (rate(mc_made_up_seconds_bucket{a="b"}[5m])))',
        "rate(mc_request_ttft_seconds[5m])",  # a histogram's bare name is not a series
    ]
    assert missing(exprs, known) == {
        exprs[1]: {"mc_made_up_seconds_bucket"},
        exprs[2]: {"mc_request_ttft_seconds"},
    }


def test_a_dashboard_with_a_renamed_metric_fails_the_check() -> None:
    board = copy.deepcopy(load_json(DASHBOARD_JSON[0]))
    target = next(t for p in panels(board) for t in p.get("targets", []))
    target["expr"] = target["expr"] + " + sum(mc_no_such_metric_total)"
    assert missing(dashboard_exprs(board), exported()) == {
        target["expr"]: {"mc_no_such_metric_total"}
    }


# --- dashboards ------------------------------------------------------------------------------


def test_dashboards_exist_with_unique_uids() -> None:
    assert len(DASHBOARD_JSON) >= 3
    uids = [load_json(p)["uid"] for p in DASHBOARD_JSON]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("path", DASHBOARD_JSON, ids=lambda p: p.name)
def test_dashboard_queries_only_exported_metrics(path: Path) -> None:
    exprs = dashboard_exprs(load_json(path))
    assert exprs
    assert missing(exprs, exported()) == {}


@pytest.mark.parametrize("path", DASHBOARD_JSON, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    board = load_json(path)
    assert board["title"] and board["uid"] and 36 <= board["schemaVersion"] <= 41
    sources = provisioned_datasources()
    ids = [p["id"] for p in panels(board)]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    boxes = []
    for p in panels(board):
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24
        boxes.append((g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"], p["title"]))
        if p["type"] == "row":
            assert "targets" not in p
            continue
        assert p["type"] in {"timeseries", "stat"}
        assert p["datasource"]["uid"] in sources
        assert p["targets"], f"{p['title']} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs)
        for t in p["targets"]:
            assert t["expr"].strip()
            assert sources.get(t["datasource"]["uid"]) == t["datasource"]["type"] == "prometheus"
    for i, a in enumerate(boxes):  # no two panels drawn over each other
        for b in boxes[i + 1 :]:
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, f"{a[4]!r} overlaps {b[4]!r}"


def test_dashboards_cover_what_operators_need() -> None:
    """The issue's list: outcomes, TTFT/TBT against the SLO, rejections by reason, queue
    depths per instance, hit rate per tier with its denominator, store usage and evictions,
    transfer throughput, recorder lag, dead letters."""
    used = set().union(
        *(metric_names(e) for p in DASHBOARD_JSON for e in dashboard_exprs(load_json(p)))
    )
    assert {
        "mc_requests_ended_total",
        "mc_conductor_terminal_total",
        "mc_requests_rejected_total",
        "mc_request_ttft_seconds_bucket",
        "mc_request_tbt_seconds_bucket",
        "mc_slo_seconds",
        "mc_instance_queue_depth",
        "mc_prefill_kv_tokens_total",
        "mc_prefill_prompt_tokens_total",
        "mc_store_used_bytes",
        "mc_store_evictions_total",
        "mc_store_transfer_bytes_total",
        "mc_recorder_lag_seconds",
        "mc_dead_letters_total",
    } <= used


def test_latency_panels_draw_the_slo_line() -> None:
    board = load_json(GRAFANA / "dashboards/mooncake-requests.json")
    for kind in ("ttft", "tbt"):
        [panel] = [p for p in panels(board) if p["title"].lower().startswith(kind)]
        exprs = [t["expr"] for t in panel["targets"]]
        assert any(f"mc_request_{kind}_seconds_bucket" in e for e in exprs)
        slo = [t for t in panel["targets"] if t["legendFormat"] == "SLO"]
        assert [t["expr"] for t in slo] == [f'max(mc_slo_seconds{{slo="{kind}"}})']
        styled = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]}
        assert "SLO" in styled


def test_dashboard_provisioning_points_at_the_json() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning/dashboards/mooncake.yml").read_text())
    [provider] = doc["providers"]
    assert provider["type"] == "file"
    # The container path the JSON directory is mounted at (docker-compose.yml).
    assert provider["options"]["path"] == "/etc/grafana/dashboards"


# --- alert rules -----------------------------------------------------------------------------


def test_alert_rules_are_complete() -> None:
    rules = load_alerts()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for r in rules:
        assert r["expr"].strip()
        assert re.fullmatch(r"\d+[smhdwy]", str(r["for"])), r["alert"]
        assert r["labels"]["severity"] in {"page", "warning"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    assert {
        "TTFTSLOBreach",
        "TBTSLOBreach",
        "RecorderLagHigh",
        "RecorderStalled",
        "DeadLettersRising",
        "InstanceDeclaredDead",
    } <= set(names)


def test_alert_rules_query_only_exported_metrics() -> None:
    exprs = [r["expr"] for r in load_alerts()]
    assert missing(exprs, exported()) == {}
    used = set().union(*(metric_names(e) for e in exprs))
    assert {
        "mc_request_ttft_seconds_bucket",
        "mc_request_tbt_seconds_bucket",
        "mc_slo_seconds",
        "mc_recorder_lag_seconds",
        "mc_dead_letters_total",
        "mc_instances_declared_dead_total",
    } <= used


def test_prometheus_loads_the_alert_rules() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    # Relative rule files resolve against the config file's directory, here and in the
    # container (/etc/prometheus/alerts.yml next to /etc/prometheus/prometheus.yml).
    assert [(DASHBOARDS / f).resolve() for f in config["rule_files"]] == [ALERTS.resolve()]
