"""The mock engine as a raw ASGI application.

Rules
  * Routes: POST /v1/chat/completions, POST /v1/completions (streaming and not),
    GET /v1/models, GET /health, GET /metrics (vllm, sglang: load gauges), GET|DELETE /mock/requests, GET /mock/stats,
    POST /mock/health {"healthy": bool} (a failing health check, for monitoring tests);
    vllm also POST /tokenize (the mock's own token IDs, tokens.py) and, with the prefix
    cache on, POST /reset_prefix_cache.
  * Prefix cache (prefix_cache_tokens > 0; cache.py): a unified or prefill engine looks
    its prompt's token IDs up when its prefill starts (FCFS, so a request queued behind
    one with the same prefix sees that one's blocks), is charged T(n - cached) (vLLM
    always computes the last prompt token: cached <= the full blocks of n - 1 tokens),
    and stores the prompt's full blocks right after. A decode engine neither looks up
    nor stores (its KV comes from the prefill engine) and reports 0 cached tokens.
  * Usage with the cache on: vllm adds "prompt_tokens_details": {"cached_tokens": N} to
    the final usage (stream and response) when N > 0, as vLLM with
    --enable-prompt-tokens-details does (N == 0: absent in a stream, null in a
    response); sglang always (--enable-cache-report); openai always (its own field).
  * KV events (vllm dialect, `kv_events` endpoint; kv_events.py): a batch per prefill
    that changed the cache (its evictions, then its stored blocks) and per reset.
  * Roles (docs/engines.md section 11): `unified` prefills then decodes; `prefill` answers
    after its prefill and, when asked with kv_transfer_params.do_remote_decode, returns
    top-level kv_transfer_params; `decode` refuses (400) a completion request whose
    kv_transfer_params lack do_remote_prefill: true, and with them skips the prefill
    (only a transfer wait) — but for a token-ID prompt (a stream migration's
    continuation, issue 24), which it prefills itself, as a vLLM decode instance runs a
    request that comes without kv_transfer_params.
  * Order of checks on a completion request: JSON -> model (404) -> `mock` options ->
    request shape -> dialect rules -> role -> early faults. Every refusal is answered
    before any byte of a stream.
  * Streaming engines send response headers at once (as real engines do), the role
    chunk and first token right after the prefill, then one token per decode step.
  * A client disconnect cancels the request's task at once (a watcher task waits for
    http.disconnect): its prefill-queue slot is freed in EngineLoad.prefill's `finally`,
    its decode-batch seat by `_settle`, and `cancelled` counts it.
  * `_settle` runs once per request, just before its last byte (so a client that has
    read the answer already sees in_flight/decoding/completed updated) or on the way out.
  * `drop` returns from the app mid-body: hypercorn then closes the connection without
    the chunked terminator, which is what a crashed engine looks like.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Any

import orjson

from . import wire
from .cache import PrefixCache
from .config import MockConfig
from .kv_events import KvEventPublisher
from .request import Refusal, max_tokens_of, reply_for, validate
from .scenarios import (
    PIECE_FAULTS,
    STREAM_FAULTS,
    Behaviour,
    BehaviourError,
    build_script,
    parse_behaviour,
    sequence_script,
    without_reasoning,
)
from .stream import renderer
from .timing import EngineLoad
from .tokens import prompt_size, prompt_token_ids

# GET /metrics: (running, waiting) gauges by dialect, the names of spec/tables/dialects.yaml
_LOAD_GAUGES = {"vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"), "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs")}

__all__ = ["MockEngine", "create_mock_app", "read_body"]

_ROUTES = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions"}
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_JSON = (b"content-type", b"application/json")
_DECODE_NEEDS_KV = "this is a decode engine: kv_transfer_params from a prefill engine (do_remote_prefill: true) are required"
_MALFORMED = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"trunc\n\n'
_OWNER = {"vllm": "vllm", "sglang": "sglang", "openai": "system"}


class _Watch:
    """One request's life: settled once, before its last byte (so a client that has read
    the answer sees the engine's counters already updated) or on the way out."""

    __slots__ = ("gone", "finished", "seated", "interrupted")

    def __init__(self) -> None:
        self.interrupted = False  # quirk "interrupts": another request cut this answer
        self.gone = False  # the client went away
        self.finished = False  # settled: the answer was handed over, ignore a disconnect
        self.seated = False  # holds a seat in the decode batch


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def read_body(receive: Any) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    parts = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def _send_json(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [_JSON, *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


class MockEngine:
    """The ASGI application of one simulated engine."""

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.load = EngineLoad(config.timing)
        self.records: deque[dict[str, Any]] = deque(maxlen=config.record_limit)
        self.healthy = True
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0  # the most requests in flight at once (engines[].max_concurrency tests)
        self.cancelled = 0
        self.completed = 0
        self.refused = 0
        self.faulted = 0
        self._blocks = 0
        self.prompt_tokens = 0  # prompts that passed their prefill (or KV transfer)
        self.cached_tokens = 0  # of those, found in the prefix cache
        self.prefill_ms = 0.0  # modelled prefill time so far (before time_scale and noise)
        self.cache = PrefixCache(config.prefix_cache_tokens, config.block_size) if config.prefix_cache_tokens > 0 else None
        self.kv_events = KvEventPublisher(config.kv_events, topic=config.kv_events_topic, fmt=config.kv_events_format) if config.kv_events else None
        self._streaming: set[_Watch] = set()  # answers streaming now (quirk "interrupts")
        self._port: int | None = config.port

    @property
    def name(self) -> str:
        return self.config.engine_name(self._port)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dialect": self.config.dialect,
            "role": self.config.role,
            "model": self.config.model,
            "requests": self.requests,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "cancelled": self.cancelled,
            "completed": self.completed,
            "refused": self.refused,
            "faulted": self.faulted,
            "prefill_queue": self.load.prefill_queue,
            "decoding": self.load.decoding,
            "prefills": self.load.prefills_done,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_ms": round(self.prefill_ms, 6),
            "prefix_cache": self._cache_stats(),
        }

    def _cache_stats(self) -> dict[str, Any] | None:
        c = self.cache
        if c is None:
            return None
        return {
            "block_size": c.block_size,
            "blocks": len(c),
            "capacity_blocks": c.capacity_blocks,
            "capacity_tokens": c.capacity_tokens,
            "kv_events": self.kv_events.endpoint if self.kv_events is not None else None,
            "kv_event_batches": self.kv_events.seq if self.kv_events is not None else 0,
        }

    def close(self) -> None:
        """Release the KV event socket (also done at lifespan shutdown)."""
        if self.kv_events is not None:
            self.kv_events.close()

    def recorded(self) -> list[dict[str, Any]]:
        while True:
            try:
                return list(self.records)
            except RuntimeError:  # mutated by the serving thread while copying
                continue

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if self._port is None and scope.get("server"):
            self._port = scope["server"][1]
        path = scope.get("raw_path") or scope["path"].encode()
        path = path.split(b"?", 1)[0]
        method = scope["method"]
        route = _ROUTES.get(path)
        if route is not None:
            if method != "POST":
                return await self._error(send, 405, "Method Not Allowed")
            return await self._completion(scope, receive, send, route)
        if path == b"/health" and method == "GET":
            status = 200 if self.healthy else 503
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == b"/v1/models" and method == "GET":
            if not self.healthy:
                return await self._error(send, 503, "engine unhealthy (mock)")
            return await _send_json(send, 200, orjson.dumps(self._models()))
        if path == b"/mock/requests":
            if method == "DELETE":
                self.records.clear()
                return await _send_json(send, 200, b'{"cleared":true}')
            return await _send_json(send, 200, orjson.dumps(self.recorded()))
        if path == b"/metrics" and method == "GET" and self.config.dialect in _LOAD_GAUGES:
            # the engine's own load, as vLLM and SGLang expose it (dialects.yaml load_metrics)
            running, waiting = _LOAD_GAUGES[self.config.dialect]
            lab = f'{{model_name="{self.config.model}"}}'
            busy = self.in_flight
            queued = max(0, self.load.prefill_queue - 1)
            text = f"# TYPE {running} gauge\n{running}{lab} {float(busy - min(busy, queued))}\n# TYPE {waiting} gauge\n{waiting}{lab} {float(min(busy, queued))}\n"
            if self.cache is not None and self.config.dialect == "vllm":  # vLLM's prefix cache counters, in tokens
                text += (f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{lab} {float(self.prompt_tokens)}\n"
                         f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{lab} {float(self.cached_tokens)}\n")
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain; version=0.0.4"), (b"content-length", str(len(text)).encode())]})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        if path == b"/tokenize" and method == "POST" and self.config.dialect == "vllm":
            return await self._tokenize(receive, send)
        if path == b"/reset_prefix_cache" and method == "POST" and self.config.dialect == "vllm" and self.cache is not None:
            self._publish(self.cache.clear())
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == b"/mock/stats":
            return await _send_json(send, 200, orjson.dumps(self.stats()))
        if path == b"/mock/health" and method == "POST":
            raw = await read_body(receive)
            try:
                self.healthy = bool(orjson.loads(raw or b"{}").get("healthy", True))
            except (orjson.JSONDecodeError, AttributeError):
                return await self._error(send, 400, 'expected {"healthy": true|false}')
            return await _send_json(send, 200, orjson.dumps({"healthy": self.healthy}))
        return await self._error(send, 404, "Not Found")

    async def _tokenize(self, receive: Any, send: Any) -> None:
        """vLLM's POST /tokenize: {"model", "messages"} or {"model", "prompt"} -> the IDs
        this engine counts as usage.prompt_tokens (no generation prompt is added)."""
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return await self._error(send, 400, "the request body is not a JSON object")
        if body.get("model", self.config.model) != self.config.model:
            return await self._error(send, 404, f"The model `{body.get('model')}` does not exist.", "model")
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                return await self._error(send, 400, "messages must be a list of message objects", "messages")
            route = "chat"
        elif isinstance(body.get("prompt"), (str, list)):
            route = "completions"
        else:
            return await self._error(send, 400, "either prompt or messages is required", "prompt")
        ids = prompt_token_ids(route, body, self.config.bytes_per_token)
        out = {"count": len(ids), "max_model_len": self.config.max_model_len or 131072, "tokens": ids, "token_strs": None}
        await _send_json(send, 200, orjson.dumps(out))

    def _publish(self, events: list[Any]) -> None:
        if self.kv_events is not None and events:
            self.kv_events.publish(events)

    def _models(self) -> dict[str, Any]:
        m: dict[str, Any] = {"id": self.config.model, "object": "model", "created": int(time.time()), "owned_by": _OWNER[self.config.dialect]}
        if self.config.dialect == "vllm":
            m.update(root=self.config.model, parent=None, max_model_len=self.config.max_model_len or 131072)
        return {"object": "list", "data": [m]}

    async def _error(self, send: Any, status: int, message: str, param: str | None = None, code: str | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await _send_json(send, status, wire.error_body(self.config.dialect, status, message, param=param, code=code), headers)

    # --- completion routes --------------------------------------------------------------

    async def _completion(self, scope: dict[str, Any], receive: Any, send: Any, route: str) -> None:
        cfg = self.config
        xrid = _header(scope, b"x-request-id")
        hdrs = [(b"x-request-id", xrid.encode())] if xrid else []
        raw = await read_body(receive)
        if raw is None:
            return
        self.requests += 1
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        rec: dict[str, Any] = {"route": route, "path": scope["path"], "x_request_id": xrid, "body": body if body is not None else raw[:2000].decode("utf-8", "replace")}
        self.records.append(rec)
        try:
            if not isinstance(body, dict):
                raise Refusal(400, "the request body is not a JSON object")
            if "model" not in body and cfg.dialect != "openai":
                body["model"] = cfg.model  # vLLM and SGLang default to the served model
            if body.get("model") != cfg.model:
                code = "model_not_found" if cfg.dialect == "openai" else None
                raise Refusal(404, f"The model `{body.get('model')}` does not exist.", "model", code)
            try:
                beh = parse_behaviour(route, body)
            except BehaviourError as e:
                raise Refusal(400, e.message, "mock") from None
            validate(cfg, route, body)
            kv = body.get("kv_transfer_params")
            remote = isinstance(kv, dict) and kv.get("do_remote_prefill") is True
            max_tokens = max_tokens_of(route, body)
            n_prompt, exact_ids = prompt_size(route, body, cfg.bytes_per_token)
            if cfg.role == "decode" and not remote and exact_ids is None:
                raise Refusal(400, _DECODE_NEEDS_KV, "kv_transfer_params")
            if cfg.max_model_len is not None and n_prompt + (max_tokens or 0) > cfg.max_model_len:
                raise Refusal(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested {n_prompt + (max_tokens or 0)} tokens ({n_prompt} in the messages, {max_tokens or 0} in the completion).", "max_tokens")
            fault = beh.fault_on(self.name)
            if fault == "reject":
                raise Refusal(400, "mock: request rejected (fault reject)")
            if fault == "error_before":
                raise Refusal(500, "mock: internal engine error (fault error_before)")
        except Refusal as r:
            self.refused += 1
            return await self._error(send, r.status, r.message, r.param, r.code, hdrs)

        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        if "interrupts" in self.config.quirks:
            for w in self._streaming:
                w.interrupted = True
        watcher = asyncio.create_task(self._watch(receive, task, watch))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await self._serve(send, route, body, beh, fault, xrid, hdrs, watch, n_prompt, exact_ids, max_tokens, remote, kv, rec)
        except asyncio.CancelledError:
            if watch.gone and task.uncancel() == 0:
                self.cancelled += 1  # the client went away: the engine is free again
                return
            raise
        finally:
            self._settle(watch, complete=False)
            watcher.cancel()

    def _settle(self, watch: _Watch, *, complete: bool) -> None:
        if watch.finished:
            return
        watch.finished = True
        self.in_flight -= 1
        if watch.seated:
            watch.seated = False
            self.load.decoding -= 1
        if complete:
            self.completed += 1

    async def _watch(self, receive: Any, task: asyncio.Task[Any], watch: _Watch) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not watch.finished:
                    watch.gone = True
                    task.cancel()
                return

    def _kv_out(self, xrid: str | None, n_prompt: int) -> dict[str, Any]:
        blocks = max(1, -(-n_prompt // 16))
        start = self._blocks
        self._blocks += blocks
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(start, start + blocks)),
            "remote_engine_id": self.name,
            "remote_request_id": xrid,
            "remote_host": host,
            "remote_port": self._port,
            "tp_size": 1,
        }

    async def _serve(self, send: Any, route: str, body: dict[str, Any], beh: Behaviour, fault: str | None, xrid: str | None, hdrs: list[tuple[bytes, bytes]], watch: _Watch, n_prompt: int, exact_ids: list[int] | None, max_tokens: int | None, remote: bool, kv_in: Any, rec: dict[str, Any]) -> None:
        cfg = self.config
        prompt_ids = exact_ids
        sequence = (cfg.sequence_output or beh.sequence) and (beh.scenario == "content" or (route == "completions" and beh.scenario != "empty"))
        if prompt_ids is None and (self.cache is not None or sequence or body.get("return_token_ids") is True):
            prompt_ids = prompt_token_ids(route, body, cfg.bytes_per_token)
        stream = body.get("stream") is True
        ignore_eos = cfg.dialect != "openai" and body.get("ignore_eos") is True
        mt = body.get("min_tokens")
        if sequence and prompt_ids is not None:
            script = sequence_script(prompt_ids, max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=mt if type(mt) is int else 0, eos_every=cfg.sequence_eos_every)
        else:
            script = build_script(beh, route=route, max_tokens=max_tokens, default_tokens=cfg.output_tokens, ignore_eos=ignore_eos, min_tokens=mt if type(mt) is int else 0)
        if cfg.dialect == "vllm" and route == "chat" and body.get("include_reasoning") is False:
            script = without_reasoning(script)
        wants_kv = cfg.role == "prefill" and isinstance(kv_in, dict) and kv_in.get("do_remote_decode") is True
        kv_out = self._kv_out(xrid, n_prompt) if wants_kv and not stream else None
        reply = reply_for(cfg, route, body, beh, fault, xrid, script, n_prompt, prompt_ids, stream, kv_out)
        if fault is not None:
            self.faulted += 1
        if fault == "stall_before":
            await self._stall(beh)  # before the first byte of the response
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *hdrs]})
        cached = 0
        if cfg.role == "decode" and remote:
            await self.load.transfer(n_prompt)
        elif self.cache is None or prompt_ids is None:
            await self.load.prefill(n_prompt, beh.prefill_ms)
            self.prefill_ms += cfg.timing.prefill_ms(n_prompt)
        else:
            cache, ids = self.cache, prompt_ids
            # vLLM computes at least the last prompt token: a hit covers at most n - 1
            cached = await self.load.prefill(n_prompt, beh.prefill_ms, cached=lambda: cache.lookup(ids[: len(ids) - 1]))
            ms = cfg.timing.prefill_ms(n_prompt - cached)
            self.prefill_ms += ms
            rec["prefill"] = {"prompt_tokens": n_prompt, "cached_tokens": cached, "ms": ms}
            self._publish(cache.insert(ids))  # no await since the prefill: FCFS order kept
        self.prompt_tokens += n_prompt
        self.cached_tokens += cached
        if self.cache is not None:
            reply = dataclasses.replace(reply, cached_tokens=cached)
        self.load.decoding += 1
        watch.seated = True
        if stream:
            await self._stream(send, reply, beh, fault, watch, body)
        else:
            await self._respond(send, reply, beh, fault, watch, hdrs)

    async def _stall(self, beh: Behaviour) -> None:
        if beh.stall_ms is None:
            await asyncio.Event().wait()  # until the client goes away (task cancelled)
        else:
            await asyncio.sleep(beh.stall_ms / 1000.0)

    def _interval(self, body: dict[str, Any]) -> int:
        cfg = self.config
        if cfg.dialect == "openai":
            return 1
        si = body.get("stream_interval")
        if cfg.dialect == "vllm" and type(si) is int and si > cfg.stream_interval:
            return si  # a request may only raise the server's interval
        return cfg.stream_interval

    async def _stream(self, send: Any, reply: wire.Reply, beh: Behaviour, fault: str | None, watch: _Watch, body: dict[str, Any]) -> None:
        rend = renderer(reply)

        async def write(ev: bytes) -> None:
            await send({"type": "http.response.body", "body": ev, "more_body": True})

        for ev in rend.head():
            await write(ev)
        self._streaming.add(watch)
        try:
            await self._stream_loop(send, reply, beh, fault, watch, body, rend, write)
        finally:
            self._streaming.discard(watch)

    async def _stream_loop(self, send: Any, reply: wire.Reply, beh: Behaviour, fault: str | None, watch: _Watch, body: dict[str, Any],
                           rend: Any, write: Any) -> None:
        loop = asyncio.get_running_loop()
        group: list[Any] = []
        next_t = loop.time()
        pieces = reply.script.pieces
        n = len(pieces)
        at = min(beh.fault_after, n)  # stream faults fire before token `at` is sent
        stream_fault = fault if fault in STREAM_FAULTS else None
        piece_at = min(beh.fault_after, n - 1) if fault in PIECE_FAULTS else -1
        interval = self._interval(body)
        tpot = beh.tpot_ms
        load = self.load
        i = 0
        while True:
            if watch.interrupted and 0 < i < n:  # quirk "interrupts": end here, short
                for ev in rend.group(group, final=True):
                    await write(ev)
                group = []
                n = i
                break
            if stream_fault is not None and i == at:
                if group:
                    for ev in rend.group(group, final=False):
                        await write(ev)
                    group = []
                if stream_fault == "error_event":
                    await write(wire.error_event(reply.dialect, "mock: the engine failed mid-stream (fault error_event)"))
                    self._settle(watch, complete=False)
                    await send({"type": "http.response.body", "body": wire.DONE})
                    return
                if stream_fault == "drop":
                    self._settle(watch, complete=False)
                    return  # no terminator: the server closes the connection
                if stream_fault == "malformed_json":
                    await write(_MALFORMED)
                elif stream_fault == "stall":
                    await self._stall(beh)
                stream_fault = None
            if i == n:
                break
            if i > 0:  # the first token comes with the prefill; then one per decode step
                next_t += load.tpot_s(tpot)
                now = loop.time()
                if next_t > now:
                    await asyncio.sleep(next_t - now)
                else:
                    next_t = now  # running late: no catch-up burst
            if i == piece_at:
                rend.pending = fault
            p = pieces[i]
            group.append(p)
            i += 1
            if i == 1 or i == n or len(group) >= interval or pieces[i].kind != p.kind or pieces[i].index != p.index:
                for ev in rend.group(group, final=i == n):
                    await write(ev)
                group = []
        if n == 0:
            for ev in rend.group([], final=True):
                await write(ev)
        if reply.usage:
            await write(rend.usage_chunk())
        self._settle(watch, complete=True)
        await send({"type": "http.response.body", "body": wire.DONE})

    async def _respond(self, send: Any, reply: wire.Reply, beh: Behaviour, fault: str | None, watch: _Watch, hdrs: list[tuple[bytes, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        for _ in range(1, len(reply.script.pieces)):
            next_t += self.load.tpot_s(beh.tpot_ms)
            now = loop.time()
            if next_t > now:
                await asyncio.sleep(next_t - now)
            else:
                next_t = now
        if fault == "error_event":
            self._settle(watch, complete=False)
            await self._error(send, 500, "mock: the engine failed during generation (fault error_event)", headers=hdrs)
            return
        data = orjson.dumps(wire.response(reply))
        if fault == "stall":
            await send({"type": "http.response.start", "status": 200, "headers": [_JSON, *hdrs]})
            await self._stall(beh)
            self._settle(watch, complete=True)
            await send({"type": "http.response.body", "body": data})
            return
        if fault == "drop":
            await send({"type": "http.response.start", "status": 200, "headers": [_JSON, *hdrs]})
            self._settle(watch, complete=False)
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            return
        if fault == "malformed_json":
            data = data[: len(data) // 2]
        self._settle(watch, complete=True)
        await _send_json(send, 200, data, hdrs)


def create_mock_app(config: MockConfig) -> MockEngine:
    """The ASGI app of one mock engine (call it as app(scope, receive, send))."""
    return MockEngine(config)
