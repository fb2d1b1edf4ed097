"""Tenants at the door (issue 22): who is asking (`identity.py`, sans-IO: a request
head's credential -> `Identity` or R15/R16) and the files the credentials come from
(`keys.py`: auth.keys_file and auth.jwt.jwks_file, watched in every data-plane process).
Per-tenant limits and fair admission will live here too."""

from .identity import Identity

__all__ = ["Identity"]
