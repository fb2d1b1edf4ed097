"""etcd over TLS with client certificates and a user (narwhal/upstream/etcd.py), as a
production etcd runs: certificates made here (trustme), a real etcd (tests/ha/etcd.py)
with --client-cert-auth, auth enabled (user root) and --auth-token-ttl 1 (a token unused
for a second is no longer valid). Leader election over it: two `narwhal serve` processes.
Every wait is bounded; every process is stopped by its PID in a fixture or `finally`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.etcd import client_settings
from narwhal.http.server import free_port
from narwhal.upstream.etcd import Etcd, EtcdError
from tests.ha.etcd import Certs, OwnEtcd, own_etcd
from tests.helpers import wait_until

USER, PASSWORD = "root", "s3cret-etcd-pw"
PW_ENV = "NARWHAL_TEST_ETCD_PASSWORD"


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    with tempfile.TemporaryDirectory(prefix="narwhal-certs-") as d:
        yield Certs(d)


@pytest.fixture(scope="module")
def etcd(certs: Certs) -> Iterator[OwnEtcd]:
    with own_etcd(certs=certs, extra=("--auth-token-ttl", "1")) as srv:
        srv.enable_auth(USER, PASSWORD)
        yield srv


def client(etcd: OwnEtcd, certs: Certs, **kw: Any) -> Etcd:
    base: dict[str, Any] = {"ca_file": certs.ca_file, "cert_file": certs.cert_file, "key_file": certs.key_file, "username": USER, "password": PASSWORD}
    return Etcd([etcd.url], timeout_s=2.0, **{**base, **kw})


def counting(c: Etcd) -> list[str]:
    """The paths the client posts (authentications among them)."""
    seen: list[str] = []
    post = c._post

    async def spy(path: str, *a: Any) -> Any:
        seen.append(path)
        return await post(path, *a)

    c._post = spy  # type: ignore[method-assign]
    return seen


def test_a_user_over_tls_authenticates_and_again_when_the_token_is_no_longer_valid(etcd: OwnEtcd, certs: Certs) -> None:
    async def main() -> None:
        c = client(etcd, certs)
        seen = counting(c)
        try:
            lease, _ = await c.grant(5)
            won = await c.campaign(b"/t/leader", b"me", lease)
            assert won.won
            kv, _ = await c.get(b"/t/leader")
            assert kv is not None and kv.value == b"me"
            assert seen.count("/v3/auth/authenticate") == 1
            c._token = "bogus.1"  # etcd no longer knows the token: invalid auth token (16)
            assert (await c.get(b"/t/leader"))[0] is not None
            assert seen.count("/v3/auth/authenticate") == 2
            await asyncio.sleep(2.5)  # --auth-token-ttl 1: the token expired unused
            assert (await c.get(b"/t/leader"))[0] is not None
            assert seen.count("/v3/auth/authenticate") == 3
            assert await c.keepalive(lease) > 0
            # a watch carries the token too
            got: list[int] = []

            async def watch() -> None:
                async for rev in c.watch_delete(b"/t/leader", won.revision + 1):
                    got.append(rev)
                    return

            w = asyncio.create_task(watch())
            await asyncio.sleep(0.2)
            await c.revoke(lease)
            await asyncio.wait_for(w, 5)
            assert got and got[0] > won.revision
        finally:
            await c.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_without_the_client_certificate_or_the_password_refused_and_the_password_shown_nowhere(etcd: OwnEtcd, certs: Certs) -> None:
    async def main() -> None:
        cases: list[tuple[Etcd, str]] = [
            (client(etcd, certs, cert_file=None, key_file=None), "no client certificate"),
            (client(etcd, certs, cert_file=certs.other_cert, key_file=certs.other_key), "a certificate of another CA"),
            (client(etcd, certs, ca_file=None), "etcd's certificate not trusted"),
            (client(etcd, certs, password="wrong-" + PASSWORD), "a wrong password"),
            (client(etcd, certs, username=None, password=None), "no user"),
        ]
        for c, why in cases:
            try:
                with pytest.raises(EtcdError) as x:
                    await c.get(b"/t/leader")
                assert PASSWORD not in str(x.value) and PASSWORD not in repr(c), why
            finally:
                await c.aclose()
        assert "authenticate as 'root'" in str(x.value) or "user name is empty" in str(x.value)

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_missing_password_variable_is_a_start_up_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PW_ENV, raising=False)
    cfg = parse_config({"ha": {"etcd": ["https://127.0.0.1:1"], "username": USER, "password_env": PW_ENV}}, source="t")
    assert cfg.ha is not None
    with pytest.raises(ConfigError, match=f"ha.password_env: the environment variable {PW_ENV} is not set"):
        client_settings(cfg.ha, where="ha")
    cfg = parse_config({"ha": {"etcd": ["https://127.0.0.1:1"], "username": USER}}, source="t")
    assert cfg.ha is not None
    with pytest.raises(ConfigError, match="ha.username: needs ha.password_env"):
        client_settings(cfg.ha, where="ha")
    cfg = parse_config({"ha": {"etcd": ["https://127.0.0.1:1"], "ca_file": "/nonexistent/ca.pem"}}, source="t")
    assert cfg.ha is not None
    with pytest.raises(ConfigError, match="ha: ca_file /nonexistent/ca.pem: not a readable file"):
        client_settings(cfg.ha, where="ha")


@contextlib.contextmanager
def routers(n: int, etcd: OwnEtcd, certs: Certs) -> Iterator[list[tuple[subprocess.Popen[bytes], str, Path]]]:
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-ha-tls-"))
    out: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    env = {**os.environ, PW_ENV: PASSWORD}
    try:
        for i in range(n):
            port = free_port()
            cfg = {
                "serving": {"listen": f"127.0.0.1:{port}", "shutdown_delay_ms": 0},
                "ha": {"etcd": [etcd.url], "key": "/narwhal-tls/leader", "name": f"r{i}", "lease_ttl_ms": 2000, "renew_interval_ms": 500,
                       "fence_margin_ms": 400, "request_timeout_ms": 1000, "ca_file": certs.ca_file, "cert_file": certs.cert_file,
                       "key_file": certs.key_file, "username": USER, "password_env": PW_ENV},
            }
            (tmp / f"r{i}.yaml").write_text(yaml.safe_dump(cfg))
            log = tmp / f"r{i}.log"
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from narwhal.cli import main; sys.exit(main())", "serve", "--config",
                                     str(tmp / f"r{i}.yaml"), "--log-level", "info"], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
            out.append((proc, f"http://127.0.0.1:{port}", log))
        yield out
    finally:
        for proc, _, _ in out:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, _ in out:
            if proc.poll() is None:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def _state(url: str) -> str | None:
    try:
        r = httpx.get(url + "/ready", timeout=1.0)
    except httpx.HTTPError:
        return None
    return "active" if r.status_code == 200 else r.json().get("state")


def test_leader_election_over_tls_with_client_certificates_and_a_user(etcd: OwnEtcd, certs: Certs) -> None:
    with routers(2, etcd, certs) as rs:
        try:
            wait_until(lambda: sorted(str(_state(u)) for _, u, _ in rs) == ["active", "standby"], timeout=20, interval=0.1, what="one leader, one standby")
        except AssertionError:
            raise AssertionError("\n".join(log.read_text()[-1500:] for _, _, log in rs)) from None
        for _, _, log in rs:
            assert PASSWORD not in log.read_text()


def test_narwhal_serve_without_the_password_variable_stops_naming_it(etcd: OwnEtcd, certs: Certs, tmp_path: Path) -> None:
    cfg = {"serving": {"listen": f"127.0.0.1:{free_port()}"},
           "ha": {"etcd": [etcd.url], "ca_file": certs.ca_file, "username": USER, "password_env": PW_ENV}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != PW_ENV}
    p = subprocess.run([sys.executable, "-c", "import sys; from narwhal.cli import main; sys.exit(main())", "serve", "--config", str(tmp_path / "c.yaml")],
                       capture_output=True, env=env, timeout=30)
    assert p.returncode != 0
    assert f"the environment variable {PW_ENV} is not set" in p.stderr.decode()
