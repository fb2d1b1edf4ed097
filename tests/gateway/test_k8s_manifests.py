"""deploy/kubernetes/gateway: the Service validates against the Kubernetes 1.37 schemas
(kubernetes-validate, strict), the patched configuration loads with narwhal's own loader
and names the picker's port, and the pieces agree: the pool's endpointPickerRef is the
picker Service, whose port reaches gateway.listen through the container's named port;
the route's backend is the pool; kustomization.yaml lists every file.

Not checked here: InferencePool, Gateway and HTTPRoute against the CRDs' own schemas
(the Gateway API and inference-extension CRD YAMLs are not in this repository); their
fields are checked by name below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from narwhal.config import parse_config

DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "gateway"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for f in sorted(DIR.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(f.read_text()):
            if d is not None:
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


DOCS = _docs()


def test_kustomization_lists_every_file() -> None:
    k = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    named = set(k["resources"]) | {p["path"] for p in k["patches"]}
    assert named - {"../"} == {f.name for f in DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert "../" in k["resources"]


def test_the_picker_service_validates() -> None:
    kubernetes_validate.validate(DOCS[("Service", "narwhal-epp")], "1.37.0", strict=True)


def test_the_configuration_loads_and_the_ports_agree() -> None:
    text = DOCS[("ConfigMap", "narwhal-config")]["data"]["narwhal.yaml"]
    cfg = parse_config(yaml.safe_load(text), source="config-patch.yaml")
    assert cfg.gateway is not None and cfg.serving.workers.root == 1  # type: ignore[union-attr]
    port = int(cfg.gateway.listen.rsplit(":", 1)[1])
    container = DOCS[("Deployment", "narwhal")]["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    svc = DOCS[("Service", "narwhal-epp")]["spec"]
    assert named[svc["ports"][0]["targetPort"]] == port
    pool = DOCS[("InferencePool", "narwhal-pool")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", "narwhal-epp", svc["ports"][0]["port"])
    assert ref["failureMode"] in ("FailClose", "FailOpen")
    assert svc["selector"] == {"app.kubernetes.io/name": "narwhal", "app.kubernetes.io/component": "router"}


def test_the_route_sends_completions_to_the_pool() -> None:
    route = DOCS[("HTTPRoute", "narwhal-completions")]
    gw = DOCS[("Gateway", "inference-gateway")]
    assert route["spec"]["parentRefs"] == [{"name": gw["metadata"]["name"]}]
    rule = route["spec"]["rules"][0]
    assert {m["path"]["value"] for m in rule["matches"]} == {"/v1/chat/completions", "/v1/completions"}
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "narwhal-pool"}]
