"""narwhal/tenants/identity.py (sans-IO) and the keys file's parser: one case a row."""

from __future__ import annotations

import hashlib
from typing import Any

import jwt
import pytest

from narwhal.tenants.identity import Identity, JwtSettings, KeyEntry, KeyTable, credential, identify
from narwhal.tenants.keys import parse_jwks, parse_keys
from narwhal_generated import errors as E

from .jwks import Signer, jwks_json

NOW = 1_800_000_000.0


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


KEYS = KeyTable.of([
    KeyEntry("k-alice", "alice", sha("sk-alice")),
    KeyEntry("k-bob", "bob", sha("sk-bob"), expires_at=NOW + 60),
    KeyEntry("k-old", "bob", sha("sk-old"), expires_at=NOW - 1),
])
ALICE = Identity("k-alice", "alice")

# -- credentials and keys ------------------------------------------------------------------

KEY_CASES: list[tuple[str, list[tuple[bytes, bytes]], Any]] = [
    ("bearer", [(b"authorization", b"Bearer sk-alice")], ALICE),
    ("bearer scheme in any case", [(b"authorization", b"bEARER   sk-alice ")], ALICE),
    ("x-api-key", [(b"x-api-key", b"sk-alice")], ALICE),
    ("both: authorization decides", [(b"x-api-key", b"sk-alice"), (b"authorization", b"Bearer sk-nope")], E.R16),
    ("both: authorization decides (valid)", [(b"x-api-key", b"sk-nope"), (b"authorization", b"Bearer sk-alice")], ALICE),
    ("other scheme, x-api-key used", [(b"authorization", b"Basic YWxpY2U6"), (b"x-api-key", b"sk-alice")], ALICE),
    ("no credential", [(b"content-type", b"application/json")], E.R15),
    ("other scheme only", [(b"authorization", b"Basic YWxpY2U6")], E.R15),
    ("bearer without a token", [(b"authorization", b"Bearer")], E.R15),
    ("bearer with blanks only", [(b"authorization", b"Bearer   ")], E.R15),
    ("empty x-api-key", [(b"x-api-key", b"")], E.R15),
    ("malformed token (space inside)", [(b"authorization", b"Bearer sk alice")], E.R16),
    ("malformed token (control byte)", [(b"x-api-key", b"sk-\x01alice")], E.R16),
    ("token too long", [(b"x-api-key", b"a" * 20000)], E.R16),
    ("unknown key", [(b"authorization", b"Bearer sk-mallory")], E.R16),
    ("key with an expiry ahead", [(b"authorization", b"Bearer sk-bob")], Identity("k-bob", "bob")),
    ("expired key", [(b"authorization", b"Bearer sk-old")], E.R16),
    ("a digest is not a key", [(b"authorization", b"Bearer " + sha("sk-alice").encode())], E.R16),
]


@pytest.mark.parametrize(("headers", "want"), [c[1:] for c in KEY_CASES], ids=[c[0] for c in KEY_CASES])
def test_keys(headers: list[tuple[bytes, bytes]], want: Any) -> None:
    assert identify(headers, KEYS, None, NOW) == want


def test_revoked_by_removal() -> None:
    h = [(b"authorization", b"Bearer sk-alice")]
    assert identify(h, KEYS, None, NOW) == ALICE
    revoked = KeyTable.of(e for e in KEYS.by_digest.values() if e.id != "k-alice")
    assert identify(h, revoked, None, NOW) is E.R16


def test_expiry_is_the_instant() -> None:
    h = [(b"authorization", b"Bearer sk-bob")]
    assert isinstance(identify(h, KEYS, None, NOW + 59.999), Identity)
    assert identify(h, KEYS, None, NOW + 60) is E.R16


def test_credential_is_the_token() -> None:
    assert credential([(b"authorization", b"Bearer abc")]) == b"abc"
    assert credential([(b"x-api-key", b" abc ")]) == b"abc"
    assert credential([]) is None


@pytest.mark.parametrize("head", [
    [(b"authorization", b"Bearer sk-bob"), (b"authorization", b"Bearer nope")],
    [(b"authorization", b"Bearer nope"), (b"authorization", b"Bearer sk-bob")],
    [(b"authorization", b"Basic eDp5"), (b"authorization", b"Bearer sk-bob")],
    [(b"x-api-key", b"sk-bob"), (b"x-api-key", b"nope")],
])
def test_two_credential_fields_are_refused_R04(head: list[tuple[bytes, bytes]]) -> None:
    """Issue 40 item 10 (rule 1): whichever one is valid, two of a field is a 400."""
    got = identify(head, KEYS, None, NOW)
    assert isinstance(got, E.ErrorRow) and got.id == "R04" and got.status == 400 and "Authorization" in got.message


# -- JWT -------------------------------------------------------------------------------------

RSA = Signer("r1", "RS256")
EC = Signer("e1", "ES256")
OTHER = Signer("r1", "RS256")  # same kid, another key: a forged signature
SETTINGS = JwtSettings(parse_jwks(jwks_json(RSA, EC).encode(), path="jwks.json"), issuer="https://idp.example", audience="narwhal")


def claims(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"iss": "https://idp.example", "aud": "narwhal", "exp": int(NOW) + 300, "sub": "svc-1", "tenant": "acme"}
    for k, v in over.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


JWT_CASES: list[tuple[str, str, Any]] = [
    ("valid RS256", RSA.token(claims()), Identity("jwt:svc-1", "acme")),
    ("valid ES256", EC.token(claims()), Identity("jwt:svc-1", "acme")),
    ("aud as a list containing ours", RSA.token(claims(aud=["other", "narwhal"])), Identity("jwt:svc-1", "acme")),
    ("no sub: key id jwt", RSA.token(claims(sub=None)), Identity("jwt", "acme")),
    ("expired", RSA.token(claims(exp=int(NOW) - 1)), E.R16),
    ("no exp", RSA.token(claims(exp=None)), E.R16),
    ("not yet valid (nbf)", RSA.token(claims(nbf=int(NOW) + 60)), E.R16),
    ("wrong issuer", RSA.token(claims(iss="https://evil.example")), E.R16),
    ("wrong audience", RSA.token(claims(aud="another-service")), E.R16),
    ("no audience", RSA.token(claims(aud=None)), E.R16),
    ("bad signature (another key, same kid)", OTHER.token(claims()), E.R16),
    ("unknown kid", RSA.token(claims(), kid="nope"), E.R16),
    ("no kid with two keys in the set", RSA.token(claims(), kid=None), E.R16),
    ("missing tenant claim", RSA.token(claims(tenant=None)), E.R16),
    ("tenant claim not a name", RSA.token(claims(tenant="a b")), E.R16),
    ("tenant claim not a string", RSA.token(claims(tenant=7)), E.R16),
    ("alg none", jwt.encode(claims(), None, algorithm="none", headers={"kid": "r1"}), E.R16),
    ("HS256 keyed with the public key", jwt.encode(claims(), "secret-secret-secret-secret-32by", algorithm="HS256", headers={"kid": "r1"}), E.R16),
    ("three parts, not a JWT", "aaa.bbb.ccc", E.R16),
]


@pytest.mark.parametrize(("token", "want"), [c[1:] for c in JWT_CASES], ids=[c[0] for c in JWT_CASES])
def test_jwt(token: str, want: Any) -> None:
    assert identify([(b"authorization", f"Bearer {token}".encode())], KEYS, SETTINGS, NOW) == want


def test_jwt_leeway_and_single_key_without_kid() -> None:
    one = JwtSettings(parse_jwks(jwks_json(RSA).encode(), path="j"), issuer="https://idp.example", audience="narwhal", leeway_s=30.0)
    late = RSA.token(claims(exp=int(NOW) - 10), kid=None)
    assert identify([(b"x-api-key", late.encode())], KEYS, one, NOW) == Identity("jwt:svc-1", "acme")
    assert identify([(b"x-api-key", late.encode())], KEYS, one, NOW + 21) is E.R16


def test_jwt_tenant_claim_and_algorithms_are_settings() -> None:
    s = JwtSettings(SETTINGS.keys, issuer="https://idp.example", audience="narwhal", tenant_claim="org", algorithms=("ES256",))
    assert identify([(b"x-api-key", EC.token(claims(org="o1")).encode())], KEYS, s, NOW) == Identity("jwt:svc-1", "o1")
    assert identify([(b"x-api-key", RSA.token(claims(org="o1")).encode())], KEYS, s, NOW) is E.R16  # RS256 not accepted


def test_a_key_wins_before_jwt() -> None:
    assert identify([(b"x-api-key", b"sk-alice")], KEYS, SETTINGS, NOW) == ALICE


# -- the keys file -----------------------------------------------------------------------------

GOOD = f"""
- {{id: k1, tenant: acme, sha256: {sha("one")}}}
- id: k2
  tenant: beta
  sha256: {sha("two").upper()}
  expires_at: 2030-01-01T00:00:00Z
- {{id: k3, tenant: beta, sha256: {sha("three")}, expires_at: 1900000000}}
"""


def test_keys_file_parses() -> None:
    t = parse_keys(GOOD.encode(), path="keys.yaml", max_keys=10)
    assert sorted(e.id for e in t.by_digest.values()) == ["k1", "k2", "k3"]
    assert t.by_digest[sha("two")].expires_at == 1893456000.0
    assert t.by_digest[sha("three")].expires_at == 1900000000.0
    assert parse_keys(b"", path="k", max_keys=1).by_digest == {}
    assert len(parse_keys(f'{{"keys": [{{"id": "a", "tenant": "t", "sha256": "{sha("x")}"}}]}}'.encode(), path="k.json", max_keys=1).by_digest) == 1


BAD_FILES: list[tuple[str, str, str]] = [
    ("not YAML", "- {id: k1, tenant: [", "keys.yaml: line 1: not valid YAML"),
    ("not a list", "id: k1", "a list of keys"),
    ("missing sha256", "- {id: k1, tenant: a}", "keys[0].sha256: missing"),
    ("unknown key", f"- {{id: k1, tenant: a, sha256: {sha('a')}, key: sk-plain}}", "keys[0].key: unknown key"),
    ("bad digest", "- {id: k1, tenant: a, sha256: sk-plain}", "keys[0].sha256: the hex SHA-256"),
    ("bad id", f"- {{id: 'k 1', tenant: a, sha256: {sha('a')}}}", "keys[0].id:"),
    ("duplicate id", f"- {{id: k1, tenant: a, sha256: {sha('a')}}}\n- {{id: k1, tenant: a, sha256: {sha('b')}}}", "line 2: keys[1].id: 'k1' names two keys"),
    ("duplicate key", f"- {{id: k1, tenant: a, sha256: {sha('a')}}}\n- {{id: k2, tenant: a, sha256: {sha('a')}}}", "keys[1].sha256: the same key is listed twice"),
    ("naive time", f"- {{id: k1, tenant: a, sha256: {sha('a')}, expires_at: '2030-01-01T00:00:00'}}", "keys[0].expires_at: an ISO-8601 time needs a time zone"),
    ("over max_keys", f"- {{id: k1, tenant: a, sha256: {sha('a')}}}\n- {{id: k2, tenant: a, sha256: {sha('b')}}}\n- {{id: k3, tenant: a, sha256: {sha('c')}}}", "over auth.max_keys (2)"),
]


@pytest.mark.parametrize(("text", "says"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_keys_file_refused_naming_line_and_key(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        parse_keys(text.encode(), path="keys.yaml", max_keys=2)
    assert says in str(e.value)
    assert "sk-plain" not in str(e.value)  # a value is never repeated back


def test_jwks_file_refused() -> None:
    with pytest.raises(ValueError, match="not a usable JSON Web Key Set"):
        parse_jwks(b'{"keys": 3}', path="jwks.json")


# -- the keys file watched (narwhal/tenants/keys.py _Watched): a change is read once it settled --

_A, _B = "sk-watch-a", "sk-watch-b"


def _keys_text(*keys: str) -> str:
    return "".join(f"- {{id: k{i}, tenant: t, sha256: {sha(k)}}}\n" for i, k in enumerate(keys))


# each step: the file's content (None: not touched), then one check; the keys known after it
WATCH_SCRIPTS: list[tuple[str, list[tuple[str | None, set[str]]]]] = [
    ("a rewrite in place seen half-way, then one that does not validate", [
        ("", {_A, _B}),  # truncated, not yet written: not read
        ("- {id: broken, tenant: x, sha256: nope}\n", {_A, _B}),
        (None, {_A, _B}),  # read now: it does not validate, the keys stay
        (None, {_A, _B}),
    ]),
    ("a change applies one check after it is seen", [
        (_keys_text(_A), {_A, _B}),
        (None, {_A}),
        (None, {_A}),
    ]),
    ("a change seen while it still changes waits for it to stand still", [
        (_keys_text(_B), {_A, _B}),
        (_keys_text(_A, _B) + "# more\n", {_A, _B}),
        (None, {_A, _B}),
    ]),
    ("an empty file that stays empty revokes every key", [
        ("", {_A, _B}),
        (None, set()),
    ]),
]


@pytest.mark.parametrize("steps", [s[1] for s in WATCH_SCRIPTS], ids=[s[0] for s in WATCH_SCRIPTS])
def test_keys_file_change_is_read_once_it_settled(tmp_path: Any, steps: list[tuple[str | None, set[str]]]) -> None:
    import asyncio
    import os

    from narwhal.tenants.keys import Auth
    from narwhal_generated.models.config import Auth as AuthConfig

    f = tmp_path / "keys.yaml"
    f.write_text(_keys_text(_A, _B))
    auth = Auth(AuthConfig.model_validate({"keys_file": str(f)}))
    digests = {sha(_A): _A, sha(_B): _B}
    for n, (text, want) in enumerate(steps):
        if text is not None:
            f.write_text(text)
            os.utime(f, ns=(n + 1, 10**18 + n))  # a stamp of its own even within one clock tick
        asyncio.run(auth.refresh())
        assert {digests[d] for d in auth.keys.by_digest} == want, f"after step {n}"
