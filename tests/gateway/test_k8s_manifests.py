"""deploy/kubernetes/gateway: the Service validates against the Kubernetes 1.37 schemas
(kubernetes-validate, strict); the InferencePool, Gateway and HTTPRoute against their
CRDs' own openAPIV3Schema (tests/gateway/crds/: extracted from the inference extension's
and the Gateway API's repositories, README there), offline with jsonschema, and a broken
manifest of each kind is refused; the patched configuration loads with narwhal's own
loader and names the picker's port, and the pieces agree: the pool's endpointPickerRef
is the picker Service, whose port reaches gateway.listen through the container's named
port; the route's backend is the pool; kustomization.yaml lists every file."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from narwhal.config import parse_config

DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "gateway"
CRDS = Path(__file__).resolve().parent / "crds"
# kind -> (apiVersion it serves, its schema's file)
CRD = {
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepool-v1.json"),
    "Gateway": ("gateway.networking.k8s.io/v1", "gateway-v1.json"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproute-v1.json"),
}


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


def _validator(kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((CRDS / CRD[kind][1]).read_text())
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def test_every_custom_resource_has_its_crd_and_validates() -> None:
    custom = {k: d for k, d in DOCS.items() if k[0] in CRD}
    assert {k[0] for k in custom} == set(CRD)  # each kind is there (and nothing escapes the check)
    for (kind, name), doc in custom.items():
        assert doc["apiVersion"] == CRD[kind][0], (kind, name)
        _validator(kind).validate(doc)


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        node: Any = doc
        for k in head:
            node = node[int(k)] if k.isdigit() else node[k]
        if value is _DROP:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return edit


_DROP = object()


@pytest.mark.parametrize(("key", "edit", "why"), [
    (("InferencePool", "narwhal-pool"), _set("spec.selector", _DROP), "selector is required"),
    (("InferencePool", "narwhal-pool"), _set("spec.targetPorts.0.number", "8000"), "a port number is an integer"),
    (("InferencePool", "narwhal-pool"), _set("spec.targetPorts.0.number", 70000), "a port number is at most 65535"),
    (("InferencePool", "narwhal-pool"), _set("spec.endpointPickerRef.failureMode", "FailSometimes"), "failureMode is an enum"),
    (("Gateway", "inference-gateway"), _set("spec.gatewayClassName", _DROP), "gatewayClassName is required"),
    (("Gateway", "inference-gateway"), _set("spec.listeners.0.port", 0), "a listener port is 1..65535"),
    (("HTTPRoute", "narwhal-completions"), _set("spec.rules.0.matches.0.path.type", "Glob"), "a path match type is an enum"),
    (("HTTPRoute", "narwhal-completions"), _set("spec.rules.0.timeouts.request", "forever"), "a timeout is a duration"),
])
def test_a_broken_manifest_is_refused(key: tuple[str, str], edit: Callable[[dict[str, Any]], None], why: str) -> None:
    doc = copy.deepcopy(DOCS[key])
    _validator(key[0]).validate(doc)  # as committed: valid
    edit(doc)
    with pytest.raises(jsonschema.ValidationError):
        _validator(key[0]).validate(doc)
