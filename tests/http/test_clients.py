"""Real clients against a real `narwhal serve`: the OpenAI Python SDK (chat and completions,
streaming and not, return_token_ids), httpx over HTTP/2 cleartext (prior knowledge) giving
the same answers as HTTP/1.1, curl --http2-prior-knowledge, and HTTPS with HTTP/2 by ALPN.
The router runs as `narwhal serve` in a subprocess on its embedded default fleet."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from narwhal.http.server import free_port
from tests.helpers import wait_until

MODEL = "narwhal-demo"


class Served:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url, self.proc = url, proc


def _serve(args: list[str], url: str, *, verify: bool | str = True) -> Iterator[Served]:
    proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"narwhal serve exited: {proc.stdout.read().decode() if proc.stdout else ''}")
            try:
                return httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=30, what="narwhal serve to answer /health")
        yield Served(url, proc)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)  # a second signal stops at once (serving.shutdown_delay_ms is not under test here)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    port = free_port()
    yield from _serve(["--listen", f"127.0.0.1:{port}"], f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def oai(served: Served):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    c = OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


MSG = [{"role": "user", "content": "Tell me about narwhals"}]


def test_sdk_chat_non_streaming(oai) -> None:  # type: ignore[no-untyped-def]
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6)
    assert r.object == "chat.completion" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert "token_ids" not in (r.choices[0].model_extra or {})


def test_sdk_chat_streaming_matches_assembled(oai) -> None:  # type: ignore[no-untyped-def]
    stream = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6)
    assert text == r.choices[0].message.content and finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == 6


def test_sdk_return_token_ids(oai) -> None:  # type: ignore[no-untyped-def]
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, extra_body={"return_token_ids": True})
    extra = r.choices[0].model_extra or {}
    assert len(extra["token_ids"]) == 5 and all(isinstance(i, int) for i in extra["token_ids"])
    ids: list[int] = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, stream=True, extra_body={"return_token_ids": True}):
        for ch in chunk.choices:
            ids += (ch.model_extra or {}).get("token_ids") or []
    assert ids == extra["token_ids"]


def test_sdk_completions(oai) -> None:  # type: ignore[no-untyped-def]
    r = oai.completions.create(model=MODEL, prompt="Narwhals are", max_tokens=4)
    assert r.object == "text_completion" and r.choices[0].text
    text = "".join(c.choices[0].text for c in oai.completions.create(model=MODEL, prompt="Narwhals are", max_tokens=4, stream=True) if c.choices)
    assert text == r.choices[0].text
    r2 = oai.completions.create(model=MODEL, prompt="Narwhals are", max_tokens=4, extra_body={"return_token_ids": True})
    assert len((r2.choices[0].model_extra or {})["token_ids"]) == 4


def test_sdk_sees_refusals_as_errors(oai) -> None:  # type: ignore[no-untyped-def]
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="other", messages=MSG)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e2:
        oai.chat.completions.create(model=MODEL, messages=MSG, n=2)
    assert e2.value.code == "invalid_sampling_width" and e2.value.param == "n"


def test_http2_prior_knowledge_gives_the_same_answers(served: Served) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 5, "return_token_ids": True}
    with httpx.Client(http1=False, http2=True, timeout=30) as h2, httpx.Client(timeout=30) as h1:
        a, b = h2.post(served.url + "/v1/chat/completions", json=body), h1.post(served.url + "/v1/chat/completions", json=body)
        assert a.http_version == "HTTP/2" and b.http_version == "HTTP/1.1"
        ja, jb = a.json(), b.json()
        assert ja["choices"] == jb["choices"] and ja["usage"] == jb["usage"]
        with h2.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}) as s2:
            lines2 = [ln for ln in s2.iter_lines() if ln]
            assert s2.http_version == "HTTP/2"
        with h1.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}) as s1:
            lines1 = [ln for ln in s1.iter_lines() if ln]
        strip = lambda ls: [ln.split('"choices"', 1)[-1] for ln in ls]  # noqa: E731 - ids/created differ per request
        assert strip(lines2) == strip(lines1) and lines2[-1] == "data: [DONE]"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_http2_prior_knowledge(served: Served) -> None:
    out = subprocess.run(
        ["curl", "-sS", "--http2-prior-knowledge", "-w", "\n%{http_version}", served.url + "/v1/chat/completions", "-H", "content-type: application/json", "-d", '{"model":"narwhal-demo","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":3}'],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    body, version = out.stdout.rsplit("\n", 1)
    assert version == "2" and body.rstrip().endswith("data: [DONE]") and body.count("data: ") >= 4


def _self_signed(d: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = d / "cert.pem", d / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def test_https_negotiates_http2_by_alpn() -> None:
    pytest.importorskip("cryptography")
    with tempfile.TemporaryDirectory() as tmp:
        certfile, keyfile = _self_signed(Path(tmp))
        port = free_port()
        cfg = Path(tmp) / "narwhal.yaml"
        cfg.write_text(yaml.safe_dump({"serving": {"listen": f"127.0.0.1:{port}", "tls": {"certfile": certfile, "keyfile": keyfile}}}))
        url = f"https://127.0.0.1:{port}"
        for s in _serve(["--config", str(cfg)], url, verify=certfile):
            with httpx.Client(http2=True, verify=certfile, timeout=30) as c:
                r = c.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 3})
                assert r.status_code == 200 and r.http_version == "HTTP/2"
            assert s.proc.poll() is None


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("admission:\n  queue_limit: -1\n  no_such_key: 1\n")
    out = subprocess.run([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "admission.queue_limit" in out.stderr and "admission.no_such_key: unknown key" in out.stderr
