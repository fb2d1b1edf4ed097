"""The router's threat model, engine credentials and the router's own address (issue 40
item 10):

  * engine credentials were kept per host and port: a later engine entry with userinfo
    for the same address (an admin PUT, a discovery file) replaced another engine's, so
    the first engine's requests went out with the second's credentials. They are kept per
    engine (narwhal/upstream/client.py);
  * the router accepted its own listen address as an engine and marked it active (a loop:
    every request it placed there came back to itself). Refused, naming the address."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from narwhal.upstream.client import EngineClient
from tests.abuse.rawengine import raw_engine
from tests.helpers import running_router


def _basic(user: str, pw: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()


def test_two_engines_behind_one_host_and_port_keep_their_own_credentials() -> None:
    with raw_engine() as eng:
        a, b = eng.url + "/a", eng.url + "/b"

        async def go() -> None:
            c = EngineClient()
            try:
                c.authorize(a, _basic("alice", "pa"))
                c.authorize(b, _basic("bob", "pb"))  # later, same host and port
                for u in (a, b, eng.url + "/ab"):
                    up = await c.open("GET", u + "/health")
                    await up.read()
                    await up.aclose()
                c.forget(b)
                up = await c.open("GET", b + "/health")
                await up.read()
                await up.aclose()
            finally:
                await c.aclose()

        asyncio.run(go())
        got = [(r.path, r.headers.get("authorization")) for r in eng.all()]
    assert got == [("/a/health", _basic("alice", "pa")), ("/b/health", _basic("bob", "pb")), ("/ab/health", None), ("/b/health", None)], got


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_router_refuses_its_own_listen_address_as_an_engine(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "tok-self")
    adm = {"authorization": "Bearer tok-self"}
    with running_router({"admission": {"mode": "open", "prediction": {"profile_on_start": False}}}) as r:
        port = r.url.rsplit(":", 1)[1]
        r.call(lambda: setattr(r.router.membership, "listen", f"127.0.0.1:{port}"))  # as narwhal serve sets it
        entry = {"name": "self", "url": f"http://{host}:{port}", "role": "unified", "dialect": "vllm"}
        got = httpx.put(r.url + "/admin/engines/self", json=entry, headers=adm, timeout=10)
        assert got.status_code == 400 and "listen" in got.json()["error"]["message"], got.text
        assert "self" not in [e["name"] for e in r.get("/v1/engines").json()["data"]]


def test_a_discovery_file_naming_the_router_itself_is_refused(tmp_path: object) -> None:
    from narwhal.authority.membership import is_self

    assert is_self("http://127.0.0.1:8000", "127.0.0.1:8000") and is_self("http://localhost:8000/v1", "127.0.0.1:8000")
    assert is_self("http://127.0.0.2:8000", "0.0.0.0:8000") and is_self("http://[::1]:8000", "[::]:8000")
    assert not is_self("http://127.0.0.1:8001", "127.0.0.1:8000") and not is_self("http://10.0.0.9:8000", "127.0.0.1:8000")
    assert not is_self("http://127.0.0.1", "127.0.0.1:8000") and is_self("http://127.0.0.1", "0.0.0.0:80")
