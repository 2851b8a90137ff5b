"""The Grafana dashboard: well-formed, and built only on metrics the processes really export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/sluicegate/dashboards/sluicegate.json"

# The metric contract shared with the gateway and engine (issue 6); histograms end in _seconds.
GATEWAY_METRICS = {
    "sluicegate_requests_total",
    "sluicegate_added_latency_seconds",
    "sluicegate_time_to_first_token_seconds",
    "sluicegate_tokens_total",
    "sluicegate_rejections_total",
    "sluicegate_upstream_errors_total",
    "sluicegate_usage_flush_lag_seconds",
}
ENGINE_METRICS = {
    "sluicegate:num_requests_running",
    "sluicegate:num_requests_waiting",
    "sluicegate:kv_cache_usage_perc",
    "sluicegate:num_preemptions_total",
    "sluicegate:prefix_cache_queries_total",
    "sluicegate:prefix_cache_hits_total",
    "sluicegate:prompt_tokens_total",
    "sluicegate:generation_tokens_total",
    "sluicegate:time_to_first_token_seconds",
    "sluicegate:inter_token_latency_seconds",
    "sluicegate:e2e_request_latency_seconds",
}
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def metric_names(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = {n for e in exprs for n in re.findall(r"sluicegate[_:][A-Za-z0-9_:]*", e)}
    return {HISTOGRAM_SERIES.sub("", n) for n in names}


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"] == "Sluicegate"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_uses_exactly_the_contract_metrics(dashboard: dict[str, Any]) -> None:
    assert metric_names(dashboard) == GATEWAY_METRICS | ENGINE_METRICS


def test_histogram_quantiles_read_bucket_series(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        for target in panel["targets"]:
            for inner in re.findall(r"histogram_quantile\([^,]+,(.*)", target["expr"]):
                assert "_bucket{" in inner and "by (le" in inner, target["expr"]


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Metric names as Prometheus scrapes them; labelled families count before any sample."""
    return {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in registry.collect()
    }


def test_gateway_exports_every_gateway_metric_the_dashboard_reads() -> None:
    from sluicegate.gateway.telemetry import REGISTRY

    assert exported_names(REGISTRY) >= GATEWAY_METRICS


def test_engine_worker_exports_every_engine_metric_the_dashboard_reads() -> None:
    from sluicegate.engine.worker.metrics import WorkerMetrics

    assert exported_names(WorkerMetrics("tiny-model").registry) >= ENGINE_METRICS


def test_status_matchers_name_statuses_the_gateway_reports(dashboard: dict[str, Any]) -> None:
    from sluicegate.gateway.telemetry import REGISTRY, model_metrics

    model_metrics("dashboard-check")
    statuses = {
        sample.labels["status"]
        for family in REGISTRY.collect()
        if family.name == "sluicegate_requests"
        for sample in family.samples
        if sample.labels.get("model") == "dashboard-check"
    }
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    matchers = [m for e in exprs for m in re.findall(r'status(=~?)"([^"]*)"', e)]
    assert matchers
    for op, value in matchers:
        matching = {s for s in statuses if re.fullmatch(value, s)} if op == "=~" else {value}
        assert matching & statuses, (op, value, statuses)
