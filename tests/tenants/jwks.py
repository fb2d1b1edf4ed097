"""Test equipment: RSA and EC key pairs made in the test, their JWKS, and tokens."""

from __future__ import annotations

import json
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

__all__ = ["Signer", "jwks_json"]


class Signer:
    def __init__(self, kid: str, alg: str = "RS256") -> None:
        self.kid = kid
        self.alg = alg
        self.key: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048) if alg.startswith(("RS", "PS")) else ec.generate_private_key(ec.SECP256R1())

    def jwk(self) -> dict[str, Any]:
        algo = jwt.get_algorithm_by_name(self.alg)
        d = json.loads(algo.to_jwk(self.key.public_key()))
        return {**d, "kid": self.kid, "alg": self.alg, "use": "sig"}

    def token(self, claims: dict[str, Any], *, kid: str | None = "", headers: dict[str, Any] | None = None) -> str:
        h = dict(headers or {})
        if kid is not None:
            h["kid"] = kid or self.kid
        return jwt.encode(claims, self.key, algorithm=self.alg, headers=h)


def jwks_json(*signers: Signer) -> str:
    return json.dumps({"keys": [s.jwk() for s in signers]})
