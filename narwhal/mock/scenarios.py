"""Per-request behaviour of a mock engine, and the output script it produces.

Rules
  * The behaviour is selected by the request body alone, so any router that forwards
    bodies unchanged can be tested: a body field `"mock": {...}`, or, when that field is
    absent, a directive `[[mock {...json...}]]` inside the prompt text (the completion
    prompt, or the text of any chat message; the last message holding one wins).
  * Unknown keys are ignored; a known key with a bad value is a 400 (a typo in a test
    must not silently run the default scenario).
  * The output is deterministic: token i of every stream has a fixed text and ID
    (`VOCAB`), so tests can predict content and IDs.
  * Theory of operation: a scenario yields its *natural* script (a tuple of `Piece`s,
    one per output token, specials included); `max_tokens` truncates it, which turns the
    finish reason into "length". usage.completion_tokens == len(script.pieces) on every
    dialect; a vLLM stream shows every piece's ID exactly once (other dialects send no
    chunk for held-back tokens and EOS, as the real engines do).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SCENARIOS",
    "FAULTS",
    "EARLY_FAULTS",
    "STREAM_FAULTS",
    "PIECE_FAULTS",
    "TOOL_FAULTS",
    "QUIRKS",
    "Behaviour",
    "BehaviourError",
    "parse_behaviour",
    "Piece",
    "Script",
    "build_script",
    "sequence_script",
    "SEQUENCE_MAX_TOKENS",
    "without_reasoning",
    "VOCAB",
    "content_piece",
    "EOS_ID",
    "THINK_OPEN_ID",
    "THINK_CLOSE_ID",
    "TOOL_OPEN_ID",
    "TOOL_CLOSE_ID",
    "TOOL_CALLS",
    "REFUSAL_WORDS",
]

SCENARIOS = frozenset({"content", "reasoning", "tool_calls", "function_call", "refusal", "empty"})

# Answered before anything is streamed (or, stall_before, before the first byte).
EARLY_FAULTS = frozenset({"error_before", "reject", "stall_before"})
# Stream-control faults: they happen just before output token `fault_after` is sent.
STREAM_FAULTS = frozenset({"malformed_json", "error_event", "drop", "stall"})
# Faults that alter the event carrying output token `fault_after`.
PIECE_FAULTS = frozenset(
    {
        "missing_token_ids",
        "bool_token_ids",
        "negative_token_ids",
        "string_token_ids",
        "audio",
        "annotations",
        "custom_tool",
        "wrong_type",
    }
)
# Faults on the first tool call opened at or after `fault_after`; they imply tool_calls.
TOOL_FAULTS = frozenset({"tool_call_no_id", "tool_call_no_name"})
FAULTS = EARLY_FAULTS | STREAM_FAULTS | PIECE_FAULTS | TOOL_FAULTS | {"no_finish_reason"}
QUIRKS = frozenset({"tgi_repeat_ids", "interrupts"})

DEFAULT_OUTPUT_TOKENS = 16


class BehaviourError(ValueError):
    """A `mock` option with a bad value; rendered as a 400 in the dialect's shape."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class Behaviour:
    """What one request asks the mock to do (all fields optional, defaults = plain answer).

    Per-request times (prefill_ms, tpot_ms, stall_ms) are wall-clock milliseconds and are
    NOT multiplied by the engine's time_scale: a case written as data cannot know it.
    """

    scenario: str = "content"
    tokens: int | None = None
    logprobs: bool = False
    usage: bool | None = None
    fault: str | None = None
    fault_after: int = 1
    fault_engines: tuple[str, ...] | None = None
    prefill_ms: float | None = None
    tpot_ms: float | None = None
    stall_ms: float | None = None
    quirks: frozenset[str] = field(default_factory=frozenset)
    sequence: bool = False  # this request's answer as MockConfig.sequence_output makes it (sequence_script)

    def fault_on(self, engine: str) -> str | None:
        """The fault this engine applies (fault_engines restricts it to named engines)."""
        if self.fault is None:
            return None
        if self.fault_engines is not None and engine not in self.fault_engines:
            return None
        return self.fault


PLAIN = Behaviour()

_DIRECTIVE = re.compile(r"\[\[mock\s*")
_DECODER = json.JSONDecoder()


def _find_directive(text: str) -> dict[str, Any] | None:
    """The last well-formed `[[mock {...}]]` in `text`."""
    found: dict[str, Any] | None = None
    for m in _DIRECTIVE.finditer(text):
        try:
            obj, end = _DECODER.raw_decode(text, m.end())
        except ValueError:
            raise BehaviourError("mock: the [[mock ...]] directive does not hold a JSON object") from None
        if not isinstance(obj, dict) or not text.startswith("]]", end):
            raise BehaviourError("mock: the [[mock ...]] directive must be [[mock {...}]]")
        found = obj
    return found


def _texts(route: str, body: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if route == "chat":
        msgs = body.get("messages")
        if isinstance(msgs, list):
            for m in msgs:
                c = m.get("content") if isinstance(m, dict) else None
                if isinstance(c, str):
                    out.append(c)
                elif isinstance(c, list):
                    out.extend(p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.extend(x for x in p if isinstance(x, str))
    return out


def _options(route: str, body: dict[str, Any]) -> dict[str, Any] | None:
    if "mock" in body:
        opts = body["mock"]
        if not isinstance(opts, dict):
            raise BehaviourError("mock: the `mock` field must be an object")
        return opts
    found = None
    for text in _texts(route, body):
        if "[[mock" in text:
            d = _find_directive(text)
            if d is not None:
                found = d
    return found


def _int(opts: dict[str, Any], key: str, lo: int) -> int | None:
    v = opts.get(key)
    if v is None:
        return None
    if type(v) is not int or v < lo:
        raise BehaviourError(f"mock: `{key}` must be an integer >= {lo}")
    return v


def _ms(opts: dict[str, Any], key: str) -> float | None:
    v = opts.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or v < 0:
        raise BehaviourError(f"mock: `{key}` must be a number >= 0 (milliseconds)")
    return float(v)


def _bool(opts: dict[str, Any], key: str) -> bool | None:
    v = opts.get(key)
    if v is None:
        return None
    if type(v) is not bool:
        raise BehaviourError(f"mock: `{key}` must be true or false")
    return v


def _names(opts: dict[str, Any], key: str, allowed: frozenset[str] | None = None) -> tuple[str, ...] | None:
    v = opts.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BehaviourError(f"mock: `{key}` must be a list of strings")
    if allowed is not None:
        bad = [x for x in v if x not in allowed]
        if bad:
            raise BehaviourError(f"mock: unknown {key} {bad[0]!r} (known: {', '.join(sorted(allowed))})")
    return tuple(v)


def parse_behaviour(route: str, body: dict[str, Any]) -> Behaviour:
    """The request's Behaviour; raises BehaviourError for a known key with a bad value."""
    opts = _options(route, body)
    if not opts:
        return PLAIN
    scenario = opts.get("scenario", "content")
    if scenario not in SCENARIOS:
        raise BehaviourError(f"mock: unknown scenario {scenario!r} (known: {', '.join(sorted(SCENARIOS))})")
    fault = opts.get("fault")
    if fault is not None and fault not in FAULTS:
        raise BehaviourError(f"mock: unknown fault {fault!r} (known: {', '.join(sorted(FAULTS))})")
    if fault in TOOL_FAULTS and scenario == "content":
        scenario = "tool_calls"  # a tool-call fault needs tool calls to act on
    quirks = _names(opts, "quirks", QUIRKS) or ()
    fault_after = _int(opts, "fault_after", 0)
    return Behaviour(
        scenario=scenario,
        tokens=_int(opts, "tokens", 0),
        logprobs=bool(_bool(opts, "logprobs")),
        usage=_bool(opts, "usage"),
        fault=fault,
        fault_after=1 if fault_after is None else fault_after,
        fault_engines=_names(opts, "fault_engines"),
        prefill_ms=_ms(opts, "prefill_ms"),
        tpot_ms=_ms(opts, "tpot_ms"),
        stall_ms=_ms(opts, "stall_ms"),
        quirks=frozenset(quirks),
        sequence=bool(_bool(opts, "sequence")),
    )


# --- the output script ------------------------------------------------------------------

CONTENT = "content"
REASONING = "reasoning"
REFUSAL = "refusal"
HIDDEN = "hidden"  # a token a parser holds back: vLLM sends `delta: {}` with its ID
TOOL_OPEN = "tool_open"  # text = function name
TOOL_ARGS = "tool_args"  # text = an arguments fragment
FN_OPEN = "fn_open"
FN_ARGS = "fn_args"

EOS_ID = 2
THINK_OPEN_ID = 3
THINK_CLOSE_ID = 4
TOOL_OPEN_ID = 5
TOOL_CLOSE_ID = 6

# Content vocabulary: token i of a content stream is VOCAB[i % len(VOCAB)], ID 1000 + that.
VOCAB: tuple[str, ...] = (
    "Narwhals", " swim", " in", " cold", " Arctic", " waters", ",", " sensing",
    " the", " world", " through", " one", " long", " spiral", " tusk", ".",
)  # fmt: skip
_REASONING_VOCAB: tuple[str, ...] = (
    "Okay", ",", " the", " user", " asks", " a", " question", ";", " let", " me", " think", ".",
)  # fmt: skip
REFUSAL_WORDS: tuple[str, ...] = ("I'm", " sorry", ",", " I", " can't", " assist", " with", " that", ".")
# The two parallel tool calls of the tool_calls scenario.
TOOL_CALLS: tuple[tuple[str, str], ...] = (("get_weather", "Paris"), ("get_weather", "Tokyo"))


@dataclass(frozen=True, slots=True)
class Piece:
    """One output token: what it renders as, and its ID."""

    kind: str
    text: str
    token_id: int
    index: int = 0  # tool-call index for TOOL_OPEN/TOOL_ARGS


@dataclass(frozen=True, slots=True)
class Script:
    pieces: tuple[Piece, ...]
    finish_reason: str  # stop | length | tool_calls | function_call
    matched_stop: int | None  # SGLang's matched_stop: the EOS ID on a natural stop


def content_piece(i: int) -> Piece:
    k = i % len(VOCAB)
    return Piece(CONTENT, VOCAB[k], 1000 + k)


def _reasoning_piece(i: int) -> Piece:
    k = i % len(_REASONING_VOCAB)
    return Piece(REASONING, _REASONING_VOCAB[k], 1100 + k)


def _eos(kind: str = CONTENT) -> Piece:
    return Piece(kind, "", EOS_ID)


def _args_pieces(kind: str, index: int, city: str, base: int) -> list[Piece]:
    return [
        Piece(kind, '{"city": "', base, index),
        Piece(kind, city, base + 1, index),
        Piece(kind, '"}', base + 2, index),
    ]


def _natural(scenario: str, n: int) -> tuple[list[Piece], str]:
    if scenario == "empty" or n == 0:
        return [], "stop"
    if scenario == "reasoning":
        n = max(n, 4)
        r = max(1, (n - 3) // 2)
        out = [Piece(HIDDEN, "<think>", THINK_OPEN_ID)]
        out += [_reasoning_piece(i) for i in range(r)]
        out.append(Piece(HIDDEN, "</think>", THINK_CLOSE_ID))
        out += [content_piece(i) for i in range(n - 3 - r)]
        out.append(_eos())
        return out, "stop"
    if scenario == "tool_calls":
        out = []
        for i, (name, city) in enumerate(TOOL_CALLS):
            out.append(Piece(HIDDEN, "<tool_call>", TOOL_OPEN_ID, i))
            out.append(Piece(TOOL_OPEN, name, 1200 + i, i))
            out += _args_pieces(TOOL_ARGS, i, city, 1210 + 10 * i)
            out.append(Piece(HIDDEN, "</tool_call>", TOOL_CLOSE_ID, i))
        out.append(_eos(HIDDEN))
        return out, "tool_calls"
    if scenario == "function_call":
        name, city = TOOL_CALLS[0]
        out = [Piece(FN_OPEN, name, 1200)] + _args_pieces(FN_ARGS, 0, city, 1210)
        out.append(_eos(HIDDEN))
        return out, "function_call"
    if scenario == "refusal":
        out = [Piece(REFUSAL, REFUSAL_WORDS[i % len(REFUSAL_WORDS)], 1300 + i % len(REFUSAL_WORDS)) for i in range(n - 1)]
        out.append(_eos())
        return out, "stop"
    return [content_piece(i) for i in range(n - 1)] + [_eos()], "stop"


def build_script(
    behaviour: Behaviour,
    *,
    route: str,
    max_tokens: int | None,
    default_tokens: int = DEFAULT_OUTPUT_TOKENS,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> Script:
    """The tokens this request generates, truncated at max_tokens (finish "length")."""
    scenario = behaviour.scenario
    if route == "completions" and scenario not in ("content", "empty"):
        scenario = "content"  # /v1/completions has only text
    if scenario == "refusal" and behaviour.tokens is None:
        n = len(REFUSAL_WORDS) + 1
    else:
        n = behaviour.tokens if behaviour.tokens is not None else default_tokens
    n = max(n, min_tokens) if scenario != "empty" else 0
    if ignore_eos and max_tokens is not None and scenario == "content":
        # ignore_eos: generation runs to max_tokens; no EOS, finish "length"
        pieces = [content_piece(i) for i in range(max_tokens)]
        return Script(tuple(pieces), "length", None)
    pieces, finish = _natural(scenario, n)
    if max_tokens is not None and max_tokens < len(pieces):
        return Script(tuple(pieces[:max_tokens]), "length", None)
    return Script(tuple(pieces), finish, EOS_ID if finish == "stop" and pieces else None)


SEQUENCE_MAX_TOKENS = 4096  # a sequence script's length when neither EOS nor max_tokens ends it


def sequence_script(prompt_ids: list[int], *, max_tokens: int | None, ignore_eos: bool = False, min_tokens: int = 0,
                    eos_every: int = 64) -> Script:
    """An answer that is a function of the whole token sequence (MockConfig.sequence_output;
    issue 24, stream migration): output token k depends only on the prompt's IDs and output
    tokens 0..k-1, so a request whose prompt is another's prompt IDs followed by its first
    k output IDs (max_tokens and min_tokens reduced by k) continues with exactly that
    answer's token k onwards: the joined answer equals the uninterrupted one.

    Rules: h = CRC-32 of the sequence so far (each ID as 4 little-endian bytes); the next
    token is EOS when eos_every > 0, h % eos_every == 0, at least min_tokens were generated
    and not ignore_eos; else VOCAB[(h >> 8) % len(VOCAB)] (ID 1000 + that index). The
    answer ends at max_tokens (finish "length"), at EOS ("stop"), or at SEQUENCE_MAX_TOKENS.
    The body's `mock.tokens` is not used: a continuation could not keep it."""
    h = zlib.crc32(struct.pack(f"<{len(prompt_ids)}I", *(i & 0xFFFFFFFF for i in prompt_ids)))
    limit = SEQUENCE_MAX_TOKENS if max_tokens is None else max(0, max_tokens)
    n_vocab = len(VOCAB)
    out: list[Piece] = []
    while len(out) < limit:
        if eos_every > 0 and not ignore_eos and len(out) >= min_tokens and h % eos_every == 0:
            out.append(_eos())
            return Script(tuple(out), "stop", EOS_ID)
        k = (h >> 8) % n_vocab
        out.append(Piece(CONTENT, VOCAB[k], 1000 + k))
        h = zlib.crc32(struct.pack("<I", 1000 + k), h)
    return Script(tuple(out), "length", None)


def without_reasoning(script: Script) -> Script:
    """vLLM `include_reasoning: false`: reasoning tokens are generated but not shown."""
    pieces = tuple(Piece(HIDDEN, p.text, p.token_id, p.index) if p.kind == REASONING else p for p in script.pieces)
    return Script(pieces, script.finish_reason, script.matched_stop)
