"""The Kubernetes deployment (deploy/kubernetes, deploy/kustomization.yaml) checked offline:

- built-in kinds against Kubernetes' own JSON schemas (kubernetes-validate, strict: an unknown
  field is an error); KServe, KEDA and Prometheus Operator resources against the schemas in
  tests/deploy/schemas (the fields used, written from those projects' API references, noted in
  each file), whose embedded Kubernetes types use Kubernetes' schemas again;
- the references between resources (selectors, Service names and ports, the Deployments KEDA
  scales, the named ports scraped, the kustomizations' files);
- every PromQL query of the KEDA triggers parses with a PromQL parser (promql-parser, the
  Rust parser's bindings) and names only documented metrics (tests/e2e/test_metrics.py checks
  them against a live server's scrape);
- and that each check fails on a manifest broken on purpose.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from python_backends.config import PROJECT_ROOT
from python_backends.gateway.config import GatewayConfig
from tests.deploy.test_dashboard import METRICS_DOC, metric_family

K8S_VERSION = "1.33.0"
DEPLOY = PROJECT_ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
OVERLAYS = sorted((DEPLOY / "kubernetes" / "overlays").glob("*/kustomization.yaml"))
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
}
K8S_SCHEMAS = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
               / f"v{K8S_VERSION}-local-strict")
PART_OF = "app.kubernetes.io/part-of"


def documents(paths: list[Path] = MANIFESTS) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


@cache  # every validation looks up the same few files (_definitions.json is large)
def _retrieve(uri: str) -> Resource[Any]:
    """Kubernetes' schemas by file name: `urn:k8s:container-v1.json` from our schemas, and
    the `/api/_definitions.json` references inside Kubernetes' own files."""
    name = uri.rsplit("/", 1)[-1].removeprefix("urn:k8s:")
    return Resource.from_contents(json.loads((K8S_SCHEMAS / name).read_text()),
                                  default_specification=DRAFT202012)


@cache
def _crd_validator(schema: str) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / schema).read_text()),
                                           registry=Registry(retrieve=_retrieve))  # type: ignore[call-arg]


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Why `doc` is not a valid resource (none: valid)."""
    crd = CRD_SCHEMAS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if crd is not None:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in _crd_validator(crd).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {doc.get('apiVersion')} {doc.get('kind')}"]
    return []


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _workload_labels(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The pod labels of every workload: InferenceService predictors and Deployments."""
    return ([d["spec"]["predictor"].get("labels", {}) for d in of_kind(docs, "InferenceService")]
            + [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(docs, "Deployment")])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_ports(docs: list[dict[str, Any]]) -> dict[str, int]:
    containers = [c for d in of_kind(docs, "ServingRuntime") for c in d["spec"]["containers"]]
    containers += [c for d in of_kind(docs, "Deployment")
                   for c in d["spec"]["template"]["spec"]["containers"]]
    return {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])
            if "name" in p}


def reference_errors(docs: list[dict[str, Any]]) -> list[str]:
    """References between the resources that do not resolve."""
    errors = []
    workloads = _workload_labels(docs)
    for d in of_kind(docs, "Service") + of_kind(docs, "PodDisruptionBudget") + of_kind(
            docs, "PodMonitor"):
        selector = d["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        if not any(_selects(selector, labels) for labels in workloads):
            errors.append(f"{d['kind']} {d['metadata']['name']} selects no workload")
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    isvcs = {d["metadata"]["name"]: d for d in of_kind(docs, "InferenceService")}
    for so in of_kind(docs, "ScaledObject"):
        target = so["spec"]["scaleTargetRef"]["name"]
        isvc = isvcs.get(target.removesuffix("-predictor"))
        if isvc is None or not target.endswith("-predictor"):
            errors.append(f"ScaledObject {so['metadata']['name']} scales {target}, which no "
                          "InferenceService makes")
        elif isvc["metadata"]["annotations"].get("serving.kserve.io/autoscalerClass") != (
                "external"):
            errors.append(f"InferenceService {isvc['metadata']['name']} is scaled by KEDA but "
                          "KServe would scale it too (autoscalerClass must be external)")
    for name, isvc in isvcs.items():
        args = isvc["spec"]["predictor"]["model"].get("args", [])
        for flag, value in itertools.pairwise(args):
            if not flag.endswith("-servers") or not value.startswith("dns:"):
                continue
            host, _, port = value[4:].rpartition(":")
            svc = services.get(host)
            if svc is None or svc["spec"].get("clusterIP") != "None" or int(port) not in [
                    p["port"] for p in svc["spec"]["ports"]]:
                errors.append(f"{name} {flag} {value}: no headless Service {host} on {port}")
    ports = _container_ports(docs)
    for pm in of_kind(docs, "PodMonitor"):
        errors += [f"PodMonitor scrapes port {e['port']}, which no container names"
                   for e in pm["spec"]["podMetricsEndpoints"] if e.get("port") not in ports]
    return errors


def keda_queries(docs: list[dict[str, Any]]) -> Iterator[str]:
    for so in of_kind(docs, "ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                yield trigger["metadata"]["query"]


def query_metrics(query: str) -> set[str]:
    """The metric families a PromQL query selects (parsed; histogram series folded)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if type(node).__name__ == "VectorSelector":
            names.add(metric_family(node.name or ""))
        for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None:
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(promql_parser.parse(query))
    return names - {""}


def test_every_manifest_is_a_valid_resource() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} >= {"ServingRuntime", "InferenceService", "Service",
                                          "PodDisruptionBudget", "PodMonitor", "ScaledObject",
                                          "Deployment", "ConfigMap"}
    errors = {f"{d['kind']} {d['metadata']['name']}": e for d in docs if (e := schema_errors(d))}
    assert not errors, errors


def test_resources_reference_each_other_correctly() -> None:
    docs = documents()
    assert reference_errors(docs) == []
    roles = {d["spec"]["predictor"]["labels"]["app.kubernetes.io/component"]
             for d in of_kind(docs, "InferenceService")}
    assert roles == {"front", "prefill", "decode"}
    assert {d["spec"]["scaleTargetRef"]["name"] for d in of_kind(docs, "ScaledObject")} == {
        "llm-prefill-predictor", "llm-decode-predictor"}
    assert all(d["metadata"]["labels"][PART_OF] == "llm-serving"
               for d in of_kind(docs, "Service"))


def test_the_gateway_configuration_loads_and_points_at_the_front_service() -> None:
    docs = documents()
    [config_map] = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "llm-gateway"]
    config = GatewayConfig.from_dict(json.loads(config_map["data"]["gateway.json"]))
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    for backend in config.backends:
        host, _, port = backend.grpc.rpartition(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]


def test_the_kustomizations_name_every_manifest_and_files_that_exist() -> None:
    base = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(DEPLOY / r for r in base["resources"]) == MANIFESTS  # none left out
    for generator in base["configMapGenerator"]:
        assert all((DEPLOY / f).is_file() for f in generator["files"])
    assert OVERLAYS
    docs = documents()
    for overlay in OVERLAYS:
        k = yaml.safe_load(overlay.read_text())
        assert all((overlay.parent / r).resolve().is_dir() for r in k["resources"])
        for patch in k["patches"]:
            ops = yaml.safe_load((overlay.parent / patch["path"]).read_text())
            assert isinstance(ops, list) and all(op["op"] in ("add", "replace") for op in ops)
            target = patch["target"]
            assert any(re.fullmatch(target["name"], d["metadata"]["name"])
                       for d in of_kind(docs, target["kind"]))


def test_keda_queries_parse_and_use_documented_metrics() -> None:
    documented = set(re.findall(r"`(llm_[a-z0-9_]+)`", METRICS_DOC.read_text()))
    queries = list(keda_queries(documents()))
    assert len(queries) == 5
    used = set().union(*(query_metrics(q) for q in queries))
    assert used == {"llm_time_to_first_token_seconds", "llm_time_per_output_token_seconds",
                    "llm_engine_busy_seconds_total", "llm_num_requests_waiting",
                    "llm_kv_cache_usage_ratio"}
    assert used <= documented, used - documented


def _doc(kind: str, name: str) -> dict[str, Any]:
    [d] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return copy.deepcopy(d)


def _gateway_port_as_text(d: dict[str, Any]) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9000"


def _keda_typo(d: dict[str, Any]) -> None:
    d["spec"]["minReplicas"] = d["spec"].pop("minReplicaCount")


def _keda_no_threshold(d: dict[str, Any]) -> None:
    del d["spec"]["triggers"][0]["metadata"]["threshold"]


def _kserve_unknown_autoscaler(d: dict[str, Any]) -> None:
    d["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] = "kedaa"


def _runtime_probe_typo(d: dict[str, Any]) -> None:
    container = d["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")


BROKEN: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("Deployment", "llm-gateway", _gateway_port_as_text, "'9000' is not of type 'integer'"),
    ("ScaledObject", "llm-prefill", _keda_typo, "'minReplicas' was unexpected"),
    ("ScaledObject", "llm-decode", _keda_no_threshold, "'threshold' is a required property"),
    ("InferenceService", "llm-prefill", _kserve_unknown_autoscaler, "'kedaa' is not one of"),
    ("ServingRuntime", "llm-triton", _runtime_probe_typo, "'readinesProbe' was unexpected"),
]


@pytest.mark.parametrize(("kind", "name", "break_it", "message"), BROKEN,
                         ids=[b[2].__name__.strip("_") for b in BROKEN])
def test_a_broken_manifest_fails_the_check(kind: str, name: str,
                                           break_it: Callable[[dict[str, Any]], None],
                                           message: str) -> None:
    doc = _doc(kind, name)
    assert schema_errors(doc) == []
    break_it(doc)
    errors = schema_errors(doc)
    assert any(message in e for e in errors), errors


def test_broken_references_and_queries_fail_the_check() -> None:
    docs = documents()
    for d in of_kind(docs, "Service"):
        if d["metadata"]["name"] == "llm-decode-headless":
            d["metadata"]["name"] = "llm-decoder-headless"
    for d in of_kind(docs, "ScaledObject"):
        d["spec"]["scaleTargetRef"]["name"] = "llm-prefil-predictor"
    errors = reference_errors(docs)
    assert any("no headless Service llm-decode-headless" in e for e in errors), errors
    assert any("scales llm-prefil-predictor" in e for e in errors), errors
    with pytest.raises(Exception, match="unclosed left parenthesis"):
        query_metrics("histogram_quantile(0.95, sum by (le) (rate(x_bucket[2m]))")
