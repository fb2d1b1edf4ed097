"""Router profiles: the mock fleet a profile runs and the router configuration that goes
with it (`narwhal conformance print-config`).

Rules
  * A profile is the contract between the suite and the router under test: the engines
    (names, roles, dialects, waves, loopback ports), the mock timing they run with, and
    the limits the cases rely on. Each case names the profile it assumes.
  * Ports are `port_base + offset`. The documented default base is 18200; `--port-base`
    moves the whole layout (print-config and the runner must be given the same base).
  * Limits are chosen so that the timing cases are decided by the mocks' scripted timing
    with wide margins, never by a race: e.g. R12 waits `max_wait_ms` (300 ms) behind a
    holder whose prefill is predicted and scripted to take 2 s; R10's holder leaves a
    predicted backlog of about 2 s against a 300 ms budget (Retry-After 2-4 s whatever a
    router's confidence margin between 1.0 and 1.5).
WARNING: changing a number here changes what the cases mean; bump SUITE_VERSION.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

from narwhal.mock import MockConfig, Timing

__all__ = ["DEFAULT_PORT_BASE", "MODEL", "HA", "MIGRATION", "RUN_KEY", "TENANT_KEYS", "TENANTS", "EngineDef", "Profile", "PROFILES", "get_profile", "router_config",
           "keys_file_entries", "mock_configs"]

DEFAULT_PORT_BASE = 18200
MODEL = "narwhal-demo"


@dataclass(frozen=True, slots=True)
class EngineDef:
    name: str
    role: str
    dialect: str
    offset: int
    wave: str | None = None
    quirks: frozenset[str] = frozenset()

    def port(self, base: int) -> int:
        return base + self.offset

    def url(self, base: int) -> str:
        return f"http://127.0.0.1:{self.port(base)}"


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    engines: tuple[EngineDef, ...]
    timing: Timing
    router: dict[str, Any]  # the router configuration without `engines`
    needs: frozenset[str] = frozenset()  # capabilities every case of the profile needs (the P/D fleet: pd)

    def listen(self, base: int = DEFAULT_PORT_BASE) -> str:
        """HOST:PORT the router under test listens on (print-config's serving.listen)."""
        host, _, port = str(self.router["serving"]["listen"]).rpartition(":")
        return f"{host}:{int(port) - DEFAULT_PORT_BASE + base}"

    def breaker_rest_s(self) -> float:
        """How long a router set up with this profile may keep an engine out after it
        failed: the breaker's cooldown and two health polls (the first successful probe
        after the cooldown closes it). The runner waits this out after a case whose engines
        faulted when the router shows no engines' eligibility (capability engines-api)."""
        m = self.router.get("monitoring") or {}
        return (float(m.get("breaker_cooldown_ms", 0)) + 2.0 * float(m.get("poll_interval_ms", 0))) / 1000.0

    def engine(self, name: str) -> EngineDef:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


# Prefill T(n) = 5 + 0.1 n ms (linear: any predictor fits it exactly); decode steps
# 4 + 3 B ms (B = sequences decoding), so a batch is visible to a TPOT predictor.
_TIMING = Timing(
    prefill_base_ms=5.0,
    prefill_per_token_ms=0.1,
    prefill_quadratic_ms=0.0,
    tpot_base_ms=4.0,
    tpot_per_seq_ms=3.0,
    transfer_base_ms=1.0,
    transfer_per_token_ms=0.0005,
)

_MONITORING = {
    "poll_interval_ms": 100,
    "stale_after_ms": 500,  # R01 monitoring_degraded half a second after health answers stop
    "poll_timeout_ms": 30000,  # a hanging health answer stays stale (not a failed poll)
    "breaker_failures": 3,
    "breaker_cooldown_ms": 300,
}

# a request must arrive whole within 2 s (H07): a stalled upload is answered 408 well
# inside the runner's bounds, and far above what any case's own upload takes.
# abuse_penalty_ms 0: the suite sends every case from one address, and failures/H10/1 is
# abuse Narwhal would otherwise answer by refusing that address's connections for 10 s
# (tests/abuse checks the penalty)
_SERVING = {"read_timeout_ms": 2000, "abuse_penalty_ms": 0}

_PREDICTION = {
    "initial_margin": 1.2,
    "adaptive_margin": False,
    "profile_on_start": True,
    "profile_prompt_tokens": [16, 512, 2048],
    "profile_output_tokens": 8,
    "profile_repeats": 1,
}

# capability ha-etcd: the election every profile's router takes part in, on the etcd the
# runner starts (its URL goes in `etcd`). A 2 s lease: a leader must fence itself within
# 2 s of etcd's last answer (router_states/S02/1 allows 1 s more for polling).
HA = {
    "key": "/narwhal-conformance/leader",
    "lease_ttl_ms": 2000,
    "renew_interval_ms": 500,
    "fence_margin_ms": 400,
    "request_timeout_ms": 500,
}


# capability tenants (issue 22): the tenants the cases act for, each with one public test
# key, and the limits each case provokes. The run's own requests carry RUN_KEY (or the
# key given with --header): tenant `conformance`, which has no entry and no limits (no
# `tenants.default` either), so every other case runs as before. One limit per tenant,
# so that one case's tenant never meets another case's limit:
#   t-in-flight  max_in_flight 1   (R17: one request held in decode, the next refused)
#   t-rate       requests_per_s 0.1 (R18: a bucket of 1 request, refilled in 10 s)
#   t-tokens     tokens_per_min 1000 (R19: a ~900-token prompt passes, the next waits ~50 s)
#   t-queue      queue_limit 0     (R20: refused whenever it would wait; served when a slot is free)
#   t-probe      requests_per_s 0.1 (detection only: two requests in a row, the second refused)
# The buckets start full when the router starts: R18/R19's cases expect their tenant's
# first request served, so run them against a router started for the run (--serve), or
# at least a minute after the last run.
RUN_KEY = "sk-narwhal-conformance-run"
TENANT_KEYS = {
    "t-in-flight": "sk-narwhal-conformance-in-flight",
    "t-rate": "sk-narwhal-conformance-rate",
    "t-tokens": "sk-narwhal-conformance-tokens",
    "t-queue": "sk-narwhal-conformance-queue",
    "t-probe": "sk-narwhal-conformance-probe",
}
RUN_TENANT = "conformance"
TENANTS: dict[str, dict[str, Any]] = {
    "t-in-flight": {"max_in_flight": 1},
    "t-rate": {"requests_per_s": 0.1},
    "t-tokens": {"tokens_per_min": 1000},
    "t-queue": {"queue_limit": 0},
    "t-probe": {"requests_per_s": 0.1},
}


# capability migration (issue 24): a decode leg that fails after response headers is
# carried on by another engine from its validated token IDs, once per request (the cases
# of table `migration` rely on one attempt: a continuation that fails too ends with the
# error event, migration/G03/1).
MIGRATION = {"max_attempts": 1}


def keys_file_entries(run_keys: list[str] | None = None) -> list[dict[str, str]]:
    """auth.keys_file's entries ({id, tenant, sha256}) for the tenants' keys and the run's
    key(s) (default RUN_KEY), all of tenant `conformance`."""
    out = [{"id": f"conformance-run-{i}", "tenant": RUN_TENANT, "sha256": hashlib.sha256(k.encode()).hexdigest()} for i, k in enumerate(run_keys or [RUN_KEY])]
    out += [{"id": f"conformance-{t}", "tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in TENANT_KEYS.items()]
    return out


def _router(listen_port: int, admission: dict[str, Any], *, wave: str | None = None) -> dict[str, Any]:
    """A profile's router configuration: its listen port, admission and own wave; the
    rest (body limit, read timeout, monitoring, admin, upstream) is every profile's."""
    serving: dict[str, Any] = {"model": MODEL, "listen": f"127.0.0.1:{listen_port}", "max_request_bytes": 262144}
    if wave is not None:
        serving["wave"] = wave
    return {
        "serving": {**serving, **_SERVING},
        "admission": admission,
        "monitoring": _MONITORING,
        "admin": {"token_env": "NARWHAL_ADMIN_TOKEN"},
        "upstream": {"idle_timeout_ms": 1000},
    }


REFERENCE = Profile(
    name="reference",
    description="vLLM prefill/decode fleet: p0 (prefill), d0 and d1 (decode); predictive admission",
    engines=(
        EngineDef("p0", "prefill", "vllm", 1, wave="a"),
        EngineDef("d0", "decode", "vllm", 2, wave="b"),
        EngineDef("d1", "decode", "vllm", 3, wave="b"),
    ),
    timing=_TIMING,
    router=_router(
        18200,
        {
            "mode": "predictive",
            "http_retention_limit": 6,
            "queue_limit": 1,
            "max_wait_ms": 300,
            "ttft_budget_ms": 300,
            "max_ttft_target_ms": 30000,
            "phase_concurrency": {"prefill": 1, "decode": 4},
            # R14: batch 3 on a decode engine projects 4 + 3*3 = 13 ms > 11.5 ms
            "prediction": {**_PREDICTION, "tpot_budget_ms": 11.5},
        },
        wave="r",
    ),
    needs=frozenset({"pd"}),
)


def _unified(name: str, dialect: str, offset: int, listen_offset: int) -> Profile:
    return Profile(
        name=dialect,
        description=f"one unified {dialect} engine ({name}); open admission",
        engines=(EngineDef(name, "unified", dialect, offset, wave="u"),),
        timing=_TIMING,
        router=_router(18200 + listen_offset, {"mode": "open", "queue_limit": 4, "max_wait_ms": 2000, "prediction": {**_PREDICTION, "profile_on_start": False}}),
    )


UNIFIED = Profile(
    name="unified",
    description="two unified vLLM engines u0 and u1 (no disaggregation); open admission",
    engines=(
        EngineDef("u0", "unified", "vllm", 31, wave="a"),
        EngineDef("u1", "unified", "vllm", 32, wave="b"),
    ),
    timing=_TIMING,
    # open admission: the limits any router can express (requests held, a queue, a
    # bounded wait) decide, not a TTFT projection; one prompt at a time per engine (a
    # unified engine holds its prefill slot until its first token)
    router=_router(
        18230,
        {
            "mode": "open",
            "http_retention_limit": 6,
            "queue_limit": 1,
            "max_wait_ms": 300,
            "phase_concurrency": {"prefill": 1, "decode": 4},
            "prediction": {**_PREDICTION, "profile_on_start": False},
        },
        wave="r",
    ),
)

PROFILES: dict[str, Profile] = {
    p.name: p for p in (REFERENCE, _unified("s0", "sglang", 11, 10), _unified("o0", "openai", 21, 20), UNIFIED)
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r} (known: {', '.join(PROFILES)})") from None


def router_config(profile: Profile, port_base: int = DEFAULT_PORT_BASE, listen: str | None = None, etcd: str | None = None,
                  keys_file: str | None = None, migration: bool = False) -> dict[str, Any]:
    """The Narwhal configuration a router under test must be set up with; with `etcd` (the
    URL of the etcd the runner started for capability ha-etcd), an `ha` section on it;
    with `keys_file` (a file of keys_file_entries(), capability tenants), an `auth`
    section naming it and the `tenants` the cases act for; with `migration` (capability
    migration), upstream.migration (MIGRATION)."""
    cfg = copy.deepcopy(profile.router)
    cfg["serving"]["listen"] = listen if listen is not None else profile.listen(port_base)
    cfg["engines"] = [
        {"name": e.name, "url": e.url(port_base), "role": e.role, "dialect": e.dialect, "wave": e.wave} for e in profile.engines
    ]
    if etcd is not None:
        cfg["ha"] = {"etcd": [etcd], **HA}
    if keys_file is not None:
        cfg["auth"] = {"keys_file": keys_file}
        cfg["tenants"] = copy.deepcopy(TENANTS)
    if migration:
        cfg["upstream"]["migration"] = dict(MIGRATION)
    return cfg


def mock_configs(profile: Profile, port_base: int = DEFAULT_PORT_BASE) -> list[MockConfig]:
    return [
        MockConfig(dialect=e.dialect, role=e.role, model=MODEL, name=e.name, port=e.port(port_base), timing=profile.timing, quirks=e.quirks)
        for e in profile.engines
    ]
