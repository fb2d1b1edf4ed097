"""auth over real HTTP: `narwhal serve` (embedded fleet) with a keys file and a JWKS, one
worker and two (each worker reads the files itself). R15/R16 with WWW-Authenticate and
the envelope, precedence after R01, the OpenAI SDK with its api_key, revocation by
rewriting the file, the books, /v1/models, the open routes, and keys in no log, metric or
error. The door's precedence (R01, then R15/R16, then R02) is tested on the door itself."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from narwhal.authority.door import LocalDoor, LocalEntry
from narwhal.core.accounting import Books
from narwhal.core.tickets import Refuse
from narwhal.http.server import free_port
from narwhal_generated import errors as E
from tests.helpers import wait_until

from .jwks import Signer, jwks_json

MODEL = "narwhal-demo"
CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
KEY_A = "sk-test-alice-5f0c2a9e7d"  # each a string that must never leave the request
KEY_B = "sk-test-bob-91b3c6d0e4"
WRONG = "sk-test-wrong-3c8e1f2a7b"
ADMIN = "admin-token-for-auth-tests"
SIGNER = Signer("k1", "RS256")


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def keys_yaml(*entries: tuple[str, str, str]) -> str:
    return yaml.safe_dump([{"id": i, "tenant": t, "sha256": sha(k)} for i, t, k in entries])


class Served:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path, keys: Path) -> None:
        self.url, self.proc, self.log, self.keys = url, proc, log, keys

    def post(self, path: str = "/v1/chat/completions", body: Any = CHAT, key: str | None = None, header: str = "authorization", **kw: Any) -> httpx.Response:
        h = dict(kw.pop("headers", {}))
        if key is not None:
            h[header] = f"Bearer {key}" if header == "authorization" else key
        return httpx.post(self.url + path, json=body, headers=h, timeout=30, **kw)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        return httpx.get(self.url + path, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=10)

    def books(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(("narwhal_requests_offered_total", "narwhal_requests_unsized_offered_total", "narwhal_requests_terminal_total")):
                name, _, v = line.rpartition(" ")
                out[name] = float(v)
        return out


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    d = tmp_path_factory.mktemp(f"auth{request.param}")
    keys = d / "keys.yaml"
    keys.write_text(keys_yaml(("k-alice", "alice", KEY_A), ("k-bob", "bob", KEY_B)))
    (d / "jwks.json").write_text(jwks_json(SIGNER))
    port = free_port()
    cfg = {
        "serving": {"listen": f"127.0.0.1:{port}", "workers": request.param},
        "auth": {"keys_file": str(keys), "keys_interval_ms": 200,
                 "jwt": {"jwks_file": str(d / "jwks.json"), "issuer": "https://idp.test", "audience": "narwhal"}},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = d / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(d / "config.yaml")], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "NARWHAL_ADMIN_TOKEN": ADMIN})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"narwhal serve exited: {log.read_text()}")
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, what="narwhal serve to be ready")
        yield Served(url, proc, log, keys)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def refused(r: httpx.Response, row: E.ErrorRow) -> dict[str, Any]:
    assert r.status_code == 401 == row.status, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "retry-after" not in r.headers
    assert r.headers.get("x-request-id")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == ("authentication_error", row.code, None)
    return err


def test_no_key_is_R15(served: Served) -> None:
    refused(served.post(), E.R15)
    refused(served.post(path="/v1/completions", body={"model": MODEL, "prompt": "hi", "max_tokens": 2}), E.R15)
    refused(served.post(headers={"authorization": "Basic YWxpY2U6"}), E.R15)


def test_wrong_key_is_R16_and_never_repeated(served: Served) -> None:
    for header in ("authorization", "x-api-key"):
        r = served.post(key=WRONG, header=header)
        refused(r, E.R16)
        assert r.headers["www-authenticate"] == 'Bearer error="invalid_token"'
        assert WRONG not in r.text and sha(WRONG) not in r.text


def test_R15_before_the_body_is_read(served: Served) -> None:
    """An unauthenticated request is answered on its head: a body that is not JSON (R06
    otherwise) or over max_request_bytes (R05) is never looked at."""
    refused(httpx.post(served.url + "/v1/chat/completions", content=b"{not json", timeout=10), E.R15)
    refused(httpx.post(served.url + "/v1/chat/completions", content=b"x" * 2_000_000, timeout=10), E.R15)
    refused(served.post(key=WRONG, body={"model": "other-model", "messages": []}), E.R16)


def test_valid_keys_are_served(served: Served) -> None:
    for key, header in ((KEY_A, "authorization"), (KEY_B, "x-api-key")):
        r = served.post(key=key, header=header)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]


def test_jwt_is_served(served: Served) -> None:
    tok = SIGNER.token({"iss": "https://idp.test", "aud": "narwhal", "exp": int(time.time()) + 300, "sub": "svc", "tenant": "acme"})
    assert served.post(key=tok).status_code == 200
    late = SIGNER.token({"iss": "https://idp.test", "aud": "narwhal", "exp": int(time.time()) - 5, "sub": "svc", "tenant": "acme"})
    refused(served.post(key=late), E.R16)


def test_openai_sdk_with_api_key(served: Served) -> None:
    import openai

    ok = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30)
    r = ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.content
    assert [m.id for m in ok.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key=WRONG, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.code == "invalid_api_key"


def test_models_needs_a_key_the_open_routes_do_not(served: Served) -> None:
    refused(served.get("/v1/models"), E.R15)
    refused(served.get("/v1/models", key=WRONG), E.R16)
    assert served.get("/v1/models", key=KEY_A).json()["data"][0]["id"] == MODEL
    for path in ("/health", "/ready", "/metrics", "/v1/engines", "/openapi.json"):
        assert served.get(path).status_code == 200, path


def test_the_books_count_R15_R16(served: Served) -> None:
    def at_rest() -> dict[str, float] | None:
        b = served.books()
        terminal = sum(v for k, v in b.items() if k.startswith("narwhal_requests_terminal_total"))
        return b if b.get("narwhal_requests_offered_total") == terminal else None

    before = wait_until(at_rest, what="books at rest")
    refused(served.post(), E.R15)
    refused(served.post(key=WRONG), E.R16)
    refused(served.get("/v1/models"), E.R15)  # not a completion route: not offered
    after = wait_until(at_rest, what="books at rest")
    inv = 'narwhal_requests_terminal_total{class="invalid_requests"}'
    assert after["narwhal_requests_offered_total"] - before["narwhal_requests_offered_total"] == 2
    assert after["narwhal_requests_unsized_offered_total"] - before["narwhal_requests_unsized_offered_total"] == 2
    assert after[inv] - before.get(inv, 0) == 2


def test_R01_comes_before_R15(served: Served) -> None:
    adm = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(served.url + "/admin/state", json={"state": "standby"}, headers=adm, timeout=10).status_code == 200
    try:
        for key in (None, WRONG, KEY_A):
            r = served.post(key=key)
            assert r.status_code == 503 and r.json()["error"]["code"] == "router_not_ready", r.text
            assert "www-authenticate" not in r.headers
    finally:
        assert httpx.post(served.url + "/admin/state", json={"state": "active"}, headers=adm, timeout=10).status_code == 200
    wait_until(lambda: served.post(key=KEY_A).status_code == 200, what="active again")


def test_revoking_a_key_by_rewriting_the_file(served: Served) -> None:
    assert served.post(key=KEY_B).status_code == 200
    served.keys.write_text(keys_yaml(("k-alice", "alice", KEY_A)))
    try:
        # every worker reads the file within two keys_interval_ms (200 ms): a few in a row
        t0 = time.monotonic()
        wait_until(lambda: all(served.post(key=KEY_B).status_code == 401 for _ in range(6)), timeout=5, what="the revoked key refused")
        assert time.monotonic() - t0 < 3
        assert served.post(key=KEY_A).status_code == 200
        # a file that does not validate leaves the keys as they were, and is counted
        served.keys.write_text("- {id: broken, tenant: x, sha256: nope}\n")
        wait_until(lambda: "narwhal_auth_source_errors_total" in served.get("/metrics").text and any(
            line.startswith('narwhal_auth_source_errors_total{source="keys_file"') and not line.endswith(" 0.0")
            for line in served.get("/metrics").text.splitlines()), timeout=5, what="the error counted")
        assert [served.post(key=KEY_A).status_code for _ in range(4)] == [200] * 4
    finally:
        served.keys.write_text(keys_yaml(("k-alice", "alice", KEY_A), ("k-bob", "bob", KEY_B)))
    wait_until(lambda: all(served.post(key=KEY_B).status_code == 200 for _ in range(6)), timeout=5, what="the key back")


def test_keys_in_no_log_or_metric(served: Served) -> None:
    served.post(key=WRONG)
    served.post(key=KEY_A)
    metrics = served.get("/metrics").text
    assert "narwhal_auth_keys" in metrics
    for secret in (KEY_A, KEY_B, WRONG, sha(KEY_A), sha(KEY_B), sha(WRONG)):
        assert secret not in metrics
        assert secret not in served.log.read_text()
    assert "k-alice" not in metrics  # no key id as a label either (unbounded)


# -- the door: R01, then the data plane's R15/R16, then R02 ------------------------------------


def door(*, ready: bool, full: bool, quotas: Any = None) -> tuple[LocalDoor, Any]:
    a = SimpleNamespace(
        books=Books(),
        state=SimpleNamespace(reason=lambda at: None if ready else "standby"),
        config=SimpleNamespace(admission=SimpleNamespace(http_retention_limit=1)),
        held=1 if full else 0,
        quotas=quotas,
        yield_retention=lambda tenant, act=True, arriving=0: None,  # nobody over its share (fair retention: tests/tenants/test_quota_http.py)
    )
    return LocalDoor(a), a  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ready", "denied", "full", "want"),
    [
        (False, E.R15, False, E.R01),
        (False, E.R16, True, E.R01),
        (True, E.R15, True, E.R15),
        (True, E.R16, True, E.R16),
        (True, E.R16, False, E.R16),
        (True, None, True, E.R02),
        (True, None, False, None),
    ],
)
def test_door_precedence(ready: bool, denied: E.ErrorRow | None, full: bool, want: E.ErrorRow | None) -> None:
    d, a = door(ready=ready, full=full)
    held = a.held
    got = d.arrive_now(0.0, None if denied is None else Refuse(denied))
    if want is None:
        assert isinstance(got, LocalEntry)
        assert a.held == held + 1
        return
    assert isinstance(got, Refuse) and got.row is want
    assert a.held == held  # a refused arrival takes no retention
    snap = a.books.snapshot()
    assert snap["offered"] == 1 and snap["unsized_offered"] == 1 and snap["terminal"][want.counter] == 1


@pytest.mark.parametrize(
    ("ready", "denied", "tenant_full", "full", "want"),
    [
        (False, None, True, True, E.R01),
        (True, E.R16, True, True, E.R16),
        (True, None, True, True, E.R17),  # the tenant's own limit before the router's (R02)
        (True, None, False, True, E.R02),
        (True, None, False, False, None),
    ],
)
def test_door_precedence_with_tenant_rows(ready: bool, denied: E.ErrorRow | None, tenant_full: bool, full: bool, want: E.ErrorRow | None) -> None:
    from narwhal.core.quota import Limits, Quotas

    q = Quotas({"acme": Limits(max_in_flight=1)})
    if tenant_full:
        assert q.arrive("acme", 0.0) is None
    d, a = door(ready=ready, full=full, quotas=q)
    a.books = Books()
    got = d.arrive_now(0.0, None if denied is None else Refuse(denied), "acme")
    if want is None:
        assert isinstance(got, LocalEntry) and q.books["acme"].in_flight == 1
        return
    assert isinstance(got, Refuse) and got.row is want
    assert q.books["acme"].in_flight == (1 if tenant_full else 0)  # a refused arrival holds no tenant slot


@pytest.mark.parametrize("pair", [
    [("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {WRONG}")],
    [("authorization", f"Bearer {WRONG}"), ("authorization", f"Bearer {KEY_A}")],
    [("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {KEY_A}")],
    [("x-api-key", KEY_A), ("x-api-key", KEY_B)],
], ids=["good-then-wrong", "wrong-then-good", "twice-the-same", "two-x-api-key"])
def test_two_authorization_headers_are_refused_400(served: Served, pair: list[tuple[str, str]]) -> None:
    """Issue 40 item 10: client identity read the last Authorization, the admin guard the
    first. Two credential fields are refused R04 (400), counted as an invalid request."""
    body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, headers=pair, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == E.R04.code, r.text
    if "auth1" in str(served.keys):  # one process; a worker process's refusal crosses the channel as its row id: the detail stays behind
        assert "Authorization" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/models", headers=pair, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == E.R04.code, r.text
