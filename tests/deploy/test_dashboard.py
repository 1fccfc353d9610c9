"""The Grafana dashboard and the Prometheus scrape configuration are well-formed and reference
only metrics this project documents (tests/e2e/test_metrics.py checks them against a live
server's scrape).

Grafana's own schema: the dashboard is decoded with grafana-foundation-sdk, whose models are
generated from the schemas Grafana publishes for its dashboard kind, panel plugins and Prometheus
queries (11.6). Every key must survive the round trip (an unknown key is dropped by the decoder)
and every value must have the type the schema gives it.
"""

from __future__ import annotations

import enum
import json
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from python_backends.config import PROJECT_ROOT

DASHBOARD = PROJECT_ROOT / "deploy" / "grafana" / "llm-serving-dashboard.json"
PROMETHEUS = PROJECT_ROOT / "deploy" / "prometheus" / "prometheus.yml"
METRICS_DOC = PROJECT_ROOT / "docs" / "metrics.md"
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
AUTOSCALER_PREFIX = "llm_autoscaler_"  # exported by scripts/autoscaler.py, not by Triton
GATEWAY_PREFIX = "gateway_"  # exported by the gateway (python_backends/gateway), not by Triton
GATEWAY_DOC = PROJECT_ROOT / "docs" / "gateway.md"


def metric_family(name: str) -> str:
    """A latency histogram's series (`..._seconds_bucket`, `_sum`, `_count`) as its family;
    any other name as it is."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith("_seconds" + suffix):
            return name.removesuffix(suffix)
    return name


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metric families the dashboard's queries use (histogram series folded to the family)."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(?:llm|gateway)_[a-z0-9_]+", target["expr"]):
                names.add(metric_family(name))
    return names


def dashboard_uses(exported: Iterable[str], prefixes: tuple[str, ...] = (),
                   exclude: tuple[str, ...] = ()) -> tuple[set[str], set[str]]:
    """(metric families the dashboard uses, those of them not in a scrape's names), counting
    only families that start with one of `prefixes` (any when empty) and none of `exclude`."""
    families = set()
    for name in exported:
        for suffix in HISTOGRAM_SUFFIXES:
            name = name.removesuffix(suffix)
        families.add(name)
    used = {m for m in dashboard_metrics(json.loads(DASHBOARD.read_text()))
            if (not prefixes or m.startswith(prefixes)) and not m.startswith(exclude)}
    return used, used - families


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


def schema_errors(value: Any, hint: Any, path: str = "$") -> list[str]:
    """Where `value` (decoded by the SDK) does not have the type Grafana's schema gives it."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return []
        tries = [schema_errors(value, h, path) for h in options]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if origin is typing.Literal:
        ok = value in typing.get_args(hint)
        return [] if ok else [f"{path}: {value!r} is not one of {typing.get_args(hint)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        (item,) = typing.get_args(hint)
        return [e for i, v in enumerate(value) for e in schema_errors(v, item, f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        _, item = typing.get_args(hint)
        return [e for k, v in value.items() for e in schema_errors(v, item, f"{path}.{k}")]
    if hint in (Any, object) and type(value).__module__.startswith("grafana_foundation_sdk"):
        hint = type(value)  # a plugin's options or query, decoded through the plugin registry
    if hint in (Any, object):
        return []
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        ok = isinstance(value, hint) or value in {m.value for m in hint}
        return [] if ok else [f"{path}: {value!r} is not one of {[m.value for m in hint]}"]
    if hint is float:
        hint = (int, float)
    if isinstance(value, bool) and hint is not bool:
        return [f"{path}: expected {hint}, got {value!r}"]
    if not isinstance(value, hint):
        return [f"{path}: expected {hint}, got {value!r}"]
    if not type(value).__module__.startswith("grafana_foundation_sdk"):
        return []
    return [e for name, h in typing.get_type_hints(type(value)).items()
            for e in schema_errors(getattr(value, name), h, f"{path}.{name}")]


def dropped_keys(original: Any, encoded: Any, path: str = "$") -> list[str]:
    """Keys of `original` that the schema's decoder did not keep (Grafana would ignore them)."""
    if isinstance(original, dict):
        if not isinstance(encoded, dict):
            return [path]
        return [e for k, v in original.items()
                for e in ([f"{path}.{k}"] if k not in encoded else
                          dropped_keys(v, encoded[k], f"{path}.{k}"))]
    if isinstance(original, list):
        if not isinstance(encoded, list) or len(encoded) != len(original):
            return [path]
        return [e for i, (a, b) in enumerate(zip(original, encoded, strict=True))
                for e in dropped_keys(a, b, f"{path}[{i}]")]
    return [] if original == encoded else [f"{path}: {original!r} became {encoded!r}"]


def grafana_schema_errors(d: dict[str, Any]) -> list[str]:
    plugins.register_default_plugins()  # panel options and queries decode by plugin type
    try:
        model = Dashboard.from_json(json.loads(json.dumps(d)))
    except (AttributeError, KeyError, TypeError) as e:
        return [f"$: does not decode: {e!r}"]
    encoded = json.loads(json.dumps(model, cls=JSONEncoder))
    return dropped_keys(d, encoded) + schema_errors(model, Dashboard)


def test_dashboard_loads_in_grafanas_schema() -> None:
    assert grafana_schema_errors(json.loads(DASHBOARD.read_text())) == []


@pytest.mark.parametrize("breakage", [
    lambda d: d.__setitem__("graphTooltip", 7),  # not a cursor-sync mode
    lambda d: d["panels"][0]["gridPos"].__setitem__("w", "wide"),
    lambda d: d["panels"][0].__setitem__("legend", {"show": True}),  # Grafana 6 graph panel key
    lambda d: d["panels"][0]["options"]["legend"].__setitem__("displayMode", "grid"),
    lambda d: d["panels"][0]["options"]["tooltip"].__setitem__("mode", "all"),
    lambda d: d["panels"][0]["targets"][0].__setitem__("exemplar", "yes"),
    lambda d: d["panels"][0]["targets"][0].__setitem__("expresion", "up"),
    lambda d: d["templating"]["list"][0].__setitem__("hide", "no"),
    lambda d: d["time"].__setitem__("form", "now-1h"),
])
def test_grafana_schema_check_rejects_what_grafana_would_not_load(breakage: Any) -> None:
    d = json.loads(DASHBOARD.read_text())
    breakage(d)
    assert grafana_schema_errors(d)


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
    documented |= set(re.findall(r"`(gateway_[a-z0-9_]+)`", GATEWAY_DOC.read_text()))
    used = dashboard_metrics(json.loads(DASHBOARD.read_text()))
    assert used <= documented, used - documented


def test_prometheus_config_scrapes_triton_the_autoscaler_and_the_gateway() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["triton-llm"]["static_configs"][0]["targets"] == ["127.0.0.1:8002"]
    assert jobs["llm-autoscaler"]["static_configs"][0]["targets"] == ["127.0.0.1:9402"]
    assert jobs["llm-gateway"]["static_configs"][0]["targets"] == ["127.0.0.1:9000"]
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())


def test_autoscaler_panels_use_what_the_autoscaler_exports() -> None:
    from python_backends.ops.autoscaler import Autoscaler, Controller, Decision, Policy

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
