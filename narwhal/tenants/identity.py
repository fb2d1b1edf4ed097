"""Who is asking (issue 22, item 1): a request head's credential, checked against the
key table and the JWT settings, is an `Identity` or the refusal row that answers it.

Rules
  1. The credential is `Authorization: Bearer <token>` (the scheme in any case, RFC 6750
     section 2.1), else `x-api-key: <token>` (OpenAI-compatible clients send either).
     When both are there, Authorization decides. An Authorization of another scheme, or
     an empty value, is no credential. Two Authorization fields (or two x-api-key) are
     refused R04 (400) whatever they hold: a proxy and the router could each read a
     different one (RFC 9110 section 11.6.2: one credential per request).
  2. No credential: R15 (missing_api_key). A credential that names no valid key: R16
     (invalid_api_key), whatever the reason (unknown, revoked, expired, a JWT that does
     not verify): the reason is not the client's to learn.
  3. A key is valid when the SHA-256 of its bytes is the digest of an entry whose
     expires_at (if any) is still ahead. Only digests are held; the digest found is
     compared with hmac.compare_digest. One SHA-256 and one dict lookup per request.
  4. With JWT settings, a credential that is no key of the table and has the shape of a
     JWT (three dot-separated parts) is verified (PyJWT): the signature by the JWKS key
     its `kid` names (or the set's only key), one of the algorithms, `exp` present and
     ahead and `nbf` (if present) behind, both within the leeway, `iss` and `aud` as
     configured, and a tenant claim that is a name (NAME).

Sans-IO: no sockets, no event loop, no files; `now` (unix seconds) is the caller's. The
key table and the key set are values the watcher (keys.py) replaces whole.

WARNING: nothing here may put a credential into an exception, a log line or a refusal's
fields: identities carry the key's `id`, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jwt

from narwhal_generated import errors as E

__all__ = ["Identity", "KeyEntry", "KeyTable", "JwtSettings", "NAME", "MAX_CREDENTIAL_BYTES", "credential", "identify"]

# key ids and tenant names: what logs, metrics and (later) tenants.NAME may carry
NAME = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
# a credential longer than this is refused R16 unhashed (a key is ~50 bytes, a JWT ~1 KB)
MAX_CREDENTIAL_BYTES = 16384
# RFC 6750 section 2.1 b64token, and what x-api-key values are: visible ASCII, no space
_TOKEN = re.compile(rb"[!-~]+")
# rule 1: two credential fields; R04 with its {detail} said (the row's counter: invalid_requests)
TWO_CREDENTIALS = replace(E.R04, message=E.R04.message.format(detail="more than one Authorization (or x-api-key) header; send one"))
_TWO = object()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request acts for: the key's id (logs, metrics) and its tenant."""

    key_id: str
    tenant: str


@dataclass(frozen=True, slots=True)
class KeyEntry:
    id: str
    tenant: str
    sha256: str  # lowercase hex
    expires_at: float | None = None  # unix seconds


@dataclass(frozen=True, slots=True)
class KeyTable:
    """auth.keys_file, as one value: entries by digest."""

    by_digest: Mapping[str, KeyEntry]

    @classmethod
    def of(cls, entries: Iterable[KeyEntry]) -> KeyTable:
        return cls({e.sha256: e for e in entries})


EMPTY = KeyTable({})


@dataclass(frozen=True, slots=True)
class JwtSettings:
    """auth.jwt with its key set loaded (a jwt.PyJWKSet)."""

    keys: Any
    issuer: str
    audience: str
    tenant_claim: str = "tenant"
    algorithms: tuple[str, ...] = ("RS256", "ES256")
    leeway_s: float = 0.0


def credential(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """Rule 1: the token a request head offers, or None. `headers` as ASGI gives them
    (lowercase names)."""
    bearer: bytes | None = None
    api_key: bytes | None = None
    auths = keys = 0
    for k, v in headers:
        if k == b"authorization":
            auths += 1
            if auths > 1:
                return _TWO  # type: ignore[return-value]  # rule 1: two of one field
            scheme, _, rest = v.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                tok = rest.strip()
                if tok:
                    bearer = tok
        elif k == b"x-api-key":
            keys += 1
            if keys > 1:
                return _TWO  # type: ignore[return-value]
            tok = v.strip()
            if tok:
                api_key = tok
    return bearer if bearer is not None else api_key


def identify(headers: Iterable[tuple[bytes, bytes]], keys: KeyTable, jwt_settings: JwtSettings | None, now: float) -> Identity | E.ErrorRow:
    """Rules 1-4: the request's Identity, or R15/R16."""
    tok = credential(headers)
    if tok is _TWO:
        return TWO_CREDENTIALS  # implements R04: two credentials (rule 1)
    if tok is None:
        return E.R15  # implements R15
    if len(tok) > MAX_CREDENTIAL_BYTES or not _TOKEN.fullmatch(tok):
        return E.R16
    digest = hashlib.sha256(tok).hexdigest()
    entry = keys.by_digest.get(digest)
    if entry is not None and hmac.compare_digest(entry.sha256, digest):
        if entry.expires_at is not None and now >= entry.expires_at:
            return E.R16  # implements R16: expired
        return Identity(entry.id, entry.tenant)
    if jwt_settings is not None and tok.count(b".") == 2:
        got = _verify_jwt(tok.decode("ascii"), jwt_settings, now)
        if got is not None:
            return got
    return E.R16  # implements R16: unknown, revoked, or a JWT that does not verify


def _verify_jwt(token: str, s: JwtSettings, now: float) -> Identity | None:
    """Rule 4. PyJWT checks the signature, algorithm, iss and aud; exp and nbf are
    checked here against `now` (PyJWT would read the wall clock itself)."""
    try:
        head = jwt.get_unverified_header(token)
        kid = head.get("kid")
        if kid is not None:
            key = s.keys[kid]
        elif len(s.keys.keys) == 1:
            key = s.keys.keys[0]
        else:
            return None
        claims = jwt.decode(
            token,
            key.key,
            algorithms=list(s.algorithms),
            audience=s.audience,
            issuer=s.issuer,
            options={"verify_exp": False, "verify_nbf": False, "verify_iat": False, "require": ["exp", "iss", "aud"]},
        )
    except (jwt.PyJWTError, KeyError, ValueError, TypeError):
        return None
    exp, nbf = claims.get("exp"), claims.get("nbf", None)
    if not _number(exp) or now >= exp + s.leeway_s:
        return None
    if nbf is not None and (not _number(nbf) or now < nbf - s.leeway_s):
        return None
    tenant = claims.get(s.tenant_claim)
    if not isinstance(tenant, str) or not NAME.fullmatch(tenant):
        return None
    sub = claims.get("sub")
    return Identity(f"jwt:{sub}" if isinstance(sub, str) and NAME.fullmatch(sub) else "jwt", tenant)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
