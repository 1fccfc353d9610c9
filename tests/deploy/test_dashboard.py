"""The Grafana dashboard and the Prometheus scrape configuration are well-formed and reference
only metrics this project documents (tests/e2e/test_metrics.py checks them against a live
server's scrape)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from python_backends.config import PROJECT_ROOT

DASHBOARD = PROJECT_ROOT / "deploy" / "grafana" / "llm-serving-dashboard.json"
PROMETHEUS = PROJECT_ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_DOC = PROJECT_ROOT / "docs" / "metrics.md"
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
AUTOSCALER_PREFIX = "llm_autoscaler_"  # exported by scripts/autoscaler.py, not by Triton


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metric families the dashboard's queries use (histogram series folded to the family)."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bllm_[a-z0-9_]+", target["expr"]):
                for suffix in HISTOGRAM_SUFFIXES:
                    if name.endswith("_seconds" + suffix):
                        name = name.removesuffix(suffix)
                names.add(name)
    return names


def validate_dashboard(d: dict[str, Any]) -> None:
    """Grafana's dashboard model (schemaVersion 39), the parts an import relies on."""
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict)):
        assert isinstance(d.get(key), kind), key
    assert 0 < len(d["uid"]) <= 40
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        assert p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy")
        assert g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_dashboard_is_a_valid_grafana_dashboard() -> None:
    validate_dashboard(json.loads(DASHBOARD.read_text()))


def test_dashboard_covers_the_signals_operators_scale_on() -> None:
    d = json.loads(DASHBOARD.read_text())
    used = dashboard_metrics(d)
    for needed in ("llm_time_to_first_token_seconds", "llm_time_per_output_token_seconds",
                   "llm_generation_tokens_total", "llm_kv_cache_usage_ratio",
                   "llm_num_requests_waiting", "llm_prefix_cache_hits_total",
                   "llm_kv_transfer_bytes_total"):
        assert needed in used, needed


def test_dashboard_uses_only_documented_metrics() -> None:
    documented = set(re.findall(r"`(llm_[a-z0-9_]+)`", METRICS_DOC.read_text()))
    used = dashboard_metrics(json.loads(DASHBOARD.read_text()))
    assert used <= documented, used - documented


def test_prometheus_config_scrapes_triton_and_the_autoscaler() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["triton-llm"]["static_configs"][0]["targets"] == ["127.0.0.1:8002"]
    assert jobs["llm-autoscaler"]["static_configs"][0]["targets"] == ["127.0.0.1:9402"]
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())


def test_autoscaler_panels_use_what_the_autoscaler_exports() -> None:
    from python_backends.autoscaler import Autoscaler, Controller, Decision, Policy

    controller = Controller(Autoscaler(Policy()), None, "", dry_run=True)  # type: ignore[arg-type]
    controller.counts = {"prefill": 2}
    controller.decisions[("prefill", "up")] = 1
    exported = set(re.findall(r"^(llm_[a-z0-9_]+)", controller.exposition(), re.M))
    used = {m for m in dashboard_metrics(json.loads(DASHBOARD.read_text()))
            if m.startswith(AUTOSCALER_PREFIX)}
    assert used and used <= exported
    assert Decision("prefill", 1, 2, "x").direction == "up"


def test_validator_rejects_broken_dashboards() -> None:
    good = json.loads(DASHBOARD.read_text())
    for breakage in (
        lambda d: d["panels"][1].__setitem__("id", d["panels"][0]["id"]),
        lambda d: d["panels"][0]["gridPos"].__setitem__("w", 30),
        lambda d: d["panels"][1].__setitem__("gridPos", dict(d["panels"][0]["gridPos"])),
        lambda d: d["panels"][0].__setitem__("type", "graphz"),
        lambda d: d.pop("schemaVersion"),
    ):
        d = json.loads(json.dumps(good))
        breakage(d)
        try:
            validate_dashboard(d)
        except (AssertionError, KeyError):
            continue
        raise AssertionError("a broken dashboard passed validation")
