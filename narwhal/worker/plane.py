"""The data plane of one process: what a request needs besides its bytes.

It holds no fleet truth: engines are their static specs (name, URL, role, dialect,
model), admission is the `door` (narwhal/core/lease.py), and the only things learned here
are this plane's own request histograms and how to count a prompt on an engine that can
(facts the authority finds while profiling, sent here). The fleet itself changes by facts
too (spec/tables/lifecycle.yaml, narwhal/authority/membership.py): ["spec", entry] (an
engine joins or changes settings; it arrives before any grant names it), ["gone"] (it
left: its pooled connections go), ["cut"] (it is leaving past its drain timeout: every
exchange with it ends now, E06), ["migrate"] (it is leaving with discovery.drain:
migrate: each decode leg on it whose request can be carried on by another engine is cut
now, E06, and carried on (spec/tables/migration.yaml); the others run on, as with wait),
["preempt", key] (core/preempt.py: the request whose lease has that key is cut, E06, and
carried on after a lighter tenant's request, if it still can be).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from narwhal_generated.models.config import NarwhalConfig

from ..core.clock import Clock, MonotonicClock
from ..core.lease import Door
from ..core.preempt import configured as preempt_configured
from ..core.prefix import token_keys
from ..tenants.keys import Auth
from ..upstream.engines import EngineSpec, engine_client
from ..upstream.usage import CountTarget, EngineCount, PromptCounter, Provisional
from .telemetry import Telemetry

__all__ = ["DataPlane", "ENGINE_REQUEST_IDS", "PREEMPTED", "tokenizer_of", "TOKENIZE_TIMEOUT_S"]

TOKENIZE_TIMEOUT_S = 1.0  # a prompt's token IDs for the KV-event index, at most this long

# the words of a fair preemption's cut (core/preempt.py): routine, logged at INFO (legs.py)
PREEMPTED = "preempted for a lighter tenant's request (admission.fair_preempt)"

# Router-only, like core.requests.ROUTER_ONLY: the engine-side request ID of vLLM
# (`request_id`) and SGLang (`rid`). A client that sets it chooses the ID the engine files
# the request under: it can collide with another request's (the engine refuses or mixes
# them up) or name one in a KV transfer. Removed from every client body on every leg.
ENGINE_REQUEST_IDS = frozenset(("request_id", "rid"))


class DataPlane:
    def __init__(self, config: NarwhalConfig, engines: list[EngineSpec], door: Door, *, worker: int = 0, clock: Clock | None = None,
                 count_tokens: Callable[[str], int] | None = None, controls: Any = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.now = self.clock.now  # one bound method for every stream's relay (memory per open stream)
        self.worker = worker  # the `worker` label of this plane's metrics
        self.engines: dict[str, EngineSpec] = {s.name: s for s in engines}
        # the open exchanges with each engine (worker/legs.py registers each leg), so
        # that a cut (lifecycle M30) reaches them; a request's leg costs one add/discard
        self.legs: dict[str, set[Any]] = {}
        # decode legs that a continuation could carry on, by engine: leg -> "may it move now?"
        self.movers: dict[str, dict[Any, Callable[[], bool]]] = {}
        # fair preemption (core/preempt.py; on when `preempt`): the same legs by their
        # lease's key, which the authority's ["preempt", key] names
        self.preempt = preempt_configured(config)
        self.preemptible: dict[int, tuple[Any, Callable[[], bool]]] = {}
        # the configured tenants (a per-tenant label on /metrics is one of them, `default` or
        # `other`, as the books' labels: core/quota.Quotas.label); None: no tenants configured
        self.tenant_labels: frozenset[str] | None = frozenset(n for n in config.tenants if n != "default") if config.tenants else None
        self.door = door
        # the operations and read models of the authority (admin API, /v1/engines, /ready,
        # /metrics): narwhal.authority.service.Controls in process, or its IPC proxy
        self.controls = controls
        self.count_tokens = count_tokens  # serving.tokenizer, when configured
        self.client = engine_client(config, engines)
        # serving.relay_path: direct -- engine reads fed to the relay from the engine
        # connection's callback, HTTP/1.1 clients written from there too (hyper.py item 11)
        self.direct_relay = config.serving.relay_path == "direct"
        self.native_relay = config.serving.relay_native  # the compiled step for common reads (worker/direct.py)
        # the pass-through policy (docs/passthrough.md): fields removed from client bodies
        # before each engine request: the engine-side request IDs, always, and the
        # operator's deny-list (the other router-only fields go in parse_request)
        self.deny_fields = frozenset(f.root for f in config.upstream.deny_fields)
        self.strip_fields = ENGINE_REQUEST_IDS | self.deny_fields
        self.prompt_counters: dict[str, PromptCounter] = {}
        self.provisional: dict[str, Provisional] = {}  # engines whose way of counting the authority has not said
        self.engine_counts: dict[str, EngineCount] = {}  # the last way to count exactly (upstream/usage.py)
        # auth (issue 22): this process's own reading of auth.keys_file / jwks_file (the
        # file is the source of truth; narwhal/tenants/keys.py); None: no key is asked for
        self.auth: Auth | None = Auth(config.auth) if config.auth is not None else None
        self._fleet_views()
        self.telemetry = Telemetry()

    def _fleet_views(self) -> None:
        """What this plane derives from the fleet's specs; again after every change."""
        engines = list(self.engines.values())
        # host names of the fleet: an engine's own error message passed on to a client
        # names none of them (narwhal/core/relay.py, engine_message)
        self.engine_hosts = tuple(sorted({h for s in engines if (h := _hostname(s.url))}))
        # admission.prediction.prefix_cache: requests carry their prefix blocks (core/prefix.py)
        mode = self.config.admission.prediction.prefix_cache
        # text keys only where some engine gets an approximate index (authority.py
        # _prefix_indexes): with events everywhere they would be computed for nothing
        phase1 = [s for s in engines if s.role != "decode"]
        self.models_prefix = mode == "approximate" or (mode == "auto" and any(not s.kv_events for s in phase1))
        # engines with KV events (exact): the prompt's token IDs from one such engine's
        # /tokenize, taken in turn (one engine does not tokenize for the whole fleet),
        # keyed in the first one's block size
        kv = [s for s in engines if s.kv_events and s.role != "decode"] if mode in ("auto", "events") else []
        self.kv_tokenizer: EngineSpec | None = kv[0] if kv else None
        self._tokenizers = itertools.cycle(kv) if kv else None

    def reconfigure(self, config: NarwhalConfig) -> None:
        """A configuration reload (narwhal/authority/reconfig.py): admission budgets and
        upstream bounds apply to every request from now on; requests running keep what
        they started with where they copied it."""
        self.config = config
        self.preempt = preempt_configured(config)
        u = config.upstream
        self.client.reconfigure(connect_timeout_s=u.connect_timeout_ms / 1000.0, idle_timeout_s=u.idle_timeout_ms / 1000.0, max_body_bytes=u.max_event_bytes)
        self.deny_fields = frozenset(f.root for f in u.deny_fields)
        self.strip_fields = ENGINE_REQUEST_IDS | self.deny_fields
        self._fleet_views()

    def tenant_budget_ms(self, tenant: str | None) -> float:
        """The TTFT budget of a request that names none: its tenant's
        (tenants.NAME.ttft_budget_ms, else tenants.default's), else admission.ttft_budget_ms."""
        ts = self.config.tenants
        if ts:
            t = ts.get(tenant) if tenant is not None else None
            t = t if t is not None else ts.get("default")
            if t is not None and t.ttft_budget_ms is not None:
                return float(t.ttft_budget_ms)
        return float(self.config.admission.ttft_budget_ms)

    def prompt_counter(self, name: str) -> PromptCounter | Provisional | None:
        """How to count `name`'s prompts exactly when its answer carries no usage: the
        way its profile found (a fact from the authority), else a provisional one that
        tries the engine's own tokenizer on the answer's prompt (upstream/usage.py), so
        no answer is an estimate where the engine can count, profile or not."""
        pc = self.prompt_counters.get(name)
        if pc is not None:
            return pc
        p = self.provisional.get(name)
        if p is None and (s := self.engines.get(name)) is not None:
            p = self.provisional[name] = Provisional(CountTarget(self.client, s.url, s.name, self.model_of(name)))
        return p

    def engine_count(self, name: str) -> EngineCount | None:
        """`name`'s own non-streaming count of a prompt, where no other way counted it
        (upstream/usage.py, `engine-count`)."""
        ec = self.engine_counts.get(name)
        if ec is None and (s := self.engines.get(name)) is not None:
            ec = self.engine_counts[name] = EngineCount(CountTarget(self.client, s.url, s.name, self.model_of(name)))
        return ec

    def model_of(self, name: str) -> str:
        return self.engines[name].model or self.config.serving.model

    def learn_facts(self, engine: str, facts: list[Any]) -> None:
        """The authority found something about `engine` (Authority.all_facts), or the
        fleet changed (module docstring)."""
        if facts and facts[0] == "preempt":  # core/preempt.py: cut it now if it can still be carried on
            got = self.preemptible.get(facts[1])
            if got is not None and got[1]():
                got[0].cut(PREEMPTED)
            return
        if facts and facts[0] == "spec":
            s = EngineSpec.from_dict(facts[1])
            if s.authorization is not None:
                self.client.authorize(s.url, s.authorization)
            self.provisional.pop(engine, None)  # its URL or model may have changed
            self.engine_counts.pop(engine, None)
            old = self.engines.get(engine)
            if old is not None:  # settings changed in place (lifecycle M07): keep what was learned
                s.kv_block_size = old.kv_block_size if old.kv_events == s.kv_events else s.kv_block_size
            self.engines[engine] = s
            self._fleet_views()
            return
        if facts and facts[0] == "migrate":
            for leg, movable in list(self.movers.get(engine, {}).items()):
                if movable():
                    leg.cut(f"engine {engine} is leaving (discovery.drain: migrate)")
            return
        if facts and facts[0] == "cut":
            for leg in list(self.legs.get(engine, ())):
                leg.cut(f"engine {engine} left the fleet (discovery.drain_timeout_ms)")
            return
        if facts and facts[0] == "gone":
            s = self.engines.pop(engine, None)
            self.prompt_counters.pop(engine, None)
            self.provisional.pop(engine, None)
            self.engine_counts.pop(engine, None)
            self.legs.pop(engine, None)
            self.movers.pop(engine, None)
            self.telemetry.forget_engine(engine)
            if s is not None and not any(o.url.split("/")[2] == s.url.split("/")[2] for o in self.engines.values()):
                self.client.forget(s.url)
            self._fleet_views()
            return
        s = self.engines.get(engine)
        if s is None or not facts:
            return
        if facts[0] == "prompt_counter":  # how it counts prompts (upstream/usage.py)
            self.prompt_counters[engine] = PromptCounter.from_facts(CountTarget(self.client, s.url, s.name, self.model_of(engine)), facts[1:])
        elif facts[0] == "kv_block_size":  # the block size of its KV events: key prompts so
            s.kv_block_size = int(facts[1])

    async def token_prefix(self, route: str, body: dict[str, Any]) -> tuple[int, ...]:
        """The prompt's block keys over its token IDs (engines with KV events), or ()
        when they cannot be had within TOKENIZE_TIMEOUT_S. Costs one /tokenize round
        trip to the engine per request with a text prompt; none for token-ID prompts."""
        first = self.kv_tokenizer
        if first is None or self._tokenizers is None:
            return ()
        bs = first.kv_block_size
        p = body.get("prompt")
        if route == "completion" and isinstance(p, list) and all(type(t) is int for t in p):
            return token_keys(p, bs)
        e = next(self._tokenizers)
        req: dict[str, Any] = {"model": self.model_of(e.name)}
        if route == "chat":
            req["messages"] = body.get("messages")
        else:
            req["prompt"] = p
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                status, raw = await self.client.post_json(e.url + "/tokenize", req, headers={"x-narwhal-profiling": "1"})
            toks = orjson.loads(raw).get("tokens") if status == 200 else None
        except Exception:  # noqa: BLE001 - an estimate then: the approximate keys still apply
            return ()
        if not isinstance(toks, list) or not all(type(t) is int for t in toks):
            return ()
        return token_keys(toks, bs)

    def sizing(self) -> dict[str, Any]:
        return {"method": "tokenizer" if self.count_tokens else "estimate"}

    async def aclose(self) -> None:
        await self.client.aclose()


def tokenizer_of(config: NarwhalConfig) -> Callable[[str], int] | None:
    """serving.tokenizer: an exact prompt counter for the data plane, or None."""
    if not config.serving.tokenizer:
        return None
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("serving.tokenizer is set but the 'tokenizers' package is not installed (pip install tokenizers)") from None
    tok = Tokenizer.from_file(config.serving.tokenizer)

    def count_tokens(text: str) -> int:
        return len(tok.encode(text).ids)

    return count_tokens


@functools.lru_cache(maxsize=1 << 16)
def _hostname(url: str) -> str | None:
    """An engine URL's host (remembered: a fleet change re-derives every engine's, issue
    40 item 4: a change costs what it changes)."""
    return urlsplit(url).hostname
