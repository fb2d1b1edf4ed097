"""deploy/kubernetes: every manifest validates against the Kubernetes 1.37 OpenAPI
schemas bundled with kubernetes-validate (offline, strict: an unknown field fails), and
the pieces agree with each other and with the router: the ConfigMap's narwhal.yaml loads
with narwhal's own config loader, terminationGracePeriodSeconds is above
serving.shutdown_grace_ms, readiness is /ready and liveness /health on the container's
port, the Services, PDB and ServiceMonitor select what they mean to, the etcd members are
the ones `ha` names, and kustomization.yaml lists every file.

The ServiceMonitor is a prometheus-operator CRD, which kubernetes-validate has no schema
for: it is validated against the pydantic models generated from the operator's CRDs
(cloudcoil-models-prometheus-operator 0.80.1.0, from PyPI: types, required fields, the
CRD's patterns), strictly (an unknown key fails: the models themselves ignore them), and
its selector, port and job are checked against the Service it scrapes."""

from __future__ import annotations

import typing
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml

from narwhal.config import parse_config
from tests.deploy.promql import ROOT

K8S = ROOT / "deploy" / "kubernetes"
VERSION = "1.37.0"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        out.extend((f.name, d) for d in yaml.safe_load_all(f.read_text()) if d is not None)
    return out


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


DOCS = _docs()


@pytest.mark.parametrize("doc", [d for _, d in DOCS if (d["apiVersion"], d["kind"]) not in CRDS],
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS if (d["apiVersion"], d["kind"]) not in CRDS])
def test_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field() -> None:
    bad = yaml.safe_load((K8S / "deployment.yaml").read_text())
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def _config() -> Any:
    cm = _one("ConfigMap", "narwhal-config")
    return parse_config(yaml.safe_load(cm["data"]["narwhal.yaml"]), source="deploy/kubernetes/configmap.yaml")


def test_the_configmap_is_a_valid_narwhal_configuration() -> None:
    cfg = _config()
    assert cfg.ha is not None and cfg.discovery.etcd is not None
    assert cfg.serving.listen.startswith("0.0.0.0:")


def test_the_deployment_probes_ports_and_grace_agree_with_the_router() -> None:
    cfg = _config()
    dep = _one("Deployment", "narwhal")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    port = int(cfg.serving.listen.rsplit(":", 1)[1])
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "http"] == [port]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # the balancer sees /ready 503 well within the delay the listener stays open
    rp = c["readinessProbe"]
    assert (rp["periodSeconds"] * rp["failureThreshold"] + rp["timeoutSeconds"]) * 1000 < cfg.serving.shutdown_delay_ms
    # the router ends by itself (delay and grace both count from the signal) before SIGKILL
    assert pod["terminationGracePeriodSeconds"] * 1000 > max(cfg.serving.shutdown_grace_ms, cfg.serving.shutdown_delay_ms) + 5000
    assert c["args"] == ["--config", "/etc/narwhal/narwhal.yaml"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["replicas"] >= 2  # a leader and a standby
    env = {e["name"]: e for e in c["env"]}
    assert cfg.admin.token_env in env


def test_services_pdb_and_servicemonitor_select_the_routers() -> None:
    dep = _one("Deployment", "narwhal")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = _one("Service", "narwhal")
    metrics = _one("Service", "narwhal-metrics")
    for s in (svc, metrics):
        assert s["spec"]["selector"].items() <= labels.items()
        assert [p["targetPort"] for p in s["spec"]["ports"]] == ["http"]
    assert metrics["spec"]["publishNotReadyAddresses"] is True  # the standby is scraped too
    assert svc["spec"].get("publishNotReadyAddresses") is not True  # clients reach the leader only
    pdb = _one("PodDisruptionBudget", "narwhal")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a standby is never Ready


def _models(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation holds (through Optional, List, Dict, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]


def unknown_keys(model: type[pydantic.BaseModel], data: Any, path: str = "") -> list[str]:
    """Keys of `data` the model (and the models it nests) has no field for."""
    if not isinstance(data, dict):
        return []
    fields = {**{n: f for n, f in model.model_fields.items()}, **{f.alias: f for f in model.model_fields.values() if f.alias}}
    out = []
    for k, v in data.items():
        f = fields.get(k)
        if f is None:
            out.append(path + k)
            continue
        for sub in _models(f.annotation):
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                out += unknown_keys(sub, item, f"{path}{k}{f'[{i}]' if isinstance(v, list) else ''}.")
    return out


def test_the_servicemonitor_validates_against_the_operators_crd_models() -> None:
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    sm = _one("ServiceMonitor", "narwhal")
    ServiceMonitor.model_validate(sm)
    assert unknown_keys(ServiceMonitor, sm) == []
    bad = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    bad["spec"]["endpoints"][0]["scrapeTimeOut"] = "5s"
    assert unknown_keys(ServiceMonitor, bad) == ["spec.endpoints[0].scrapeTimeOut"]
    bad["spec"]["endpoints"][0]["interval"] = "15 seconds"  # the CRD's duration pattern
    with pytest.raises(pydantic.ValidationError):
        ServiceMonitor.model_validate(bad)


def test_the_servicemonitor_scrapes_the_metrics_service_as_job_narwhal() -> None:
    sm = _one("ServiceMonitor", "narwhal")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    metrics = _one("Service", "narwhal-metrics")
    assert spec["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"].items() > set()
    # the job is the value of jobLabel on the Service: `narwhal`, as the alerts expect
    assert metrics["metadata"]["labels"][spec["jobLabel"]] == "narwhal"
    (ep,) = spec["endpoints"]
    assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
    assert ep["port"] in {p["name"] for p in metrics["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    for k in ("interval", "scrapeTimeout"):
        assert isinstance(ep[k], str) and ep[k][:-1].isdigit() and ep[k][-1] in "sm"


def test_etcd_members_are_the_ones_ha_names() -> None:
    cfg = _config()
    sts = _one("StatefulSet", "narwhal-etcd")
    svc = _one("Service", "narwhal-etcd")
    n, name, svc_name = sts["spec"]["replicas"], sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert svc_name == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert [getattr(e, "root", e) for e in cfg.ha.etcd] == [f"http://{name}-{i}.{svc_name}:2379" for i in range(n)]
    cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--initial-cluster=" + ",".join(f"{name}-{i}=http://{name}-{i}.{svc_name}:2380" for i in range(n)) in cmd
    assert _one("PodDisruptionBudget", "narwhal-etcd")["spec"]["minAvailable"] == n // 2 + 1  # quorum
