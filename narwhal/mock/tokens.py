"""The mock engine's tokenizer: prompt sizes (usage.prompt_tokens) and prompt token IDs.

Rules (exact, so a router can reproduce the IDs; `bpt` = MockConfig.bytes_per_token)
  * Token-ID prompts (completions `prompt` as a list of ints, or a list of such lists,
    flattened) are their own IDs.
  * A text prompt is a list of segments, one per chat message (its text: a string
    `content`, or the `text` of each content part, then each tool call's function name
    and arguments, all UTF-8), or one segment for a completions prompt (a string, or a
    list of strings joined with "\\n"). S = the segments' bytes concatenated, N = len(S).
  * Count: n = ceil(N / bpt) + CHAT_MESSAGE_TOKENS per chat message, at least 1. This is
    usage.prompt_tokens, and the length of the ID list below.
  * Text pieces: piece k (k = 0 .. ceil(N / bpt) - 1) covers bytes [floor(k*bpt),
    floor((k+1)*bpt)) of S. A piece belongs to the message holding its first byte.
  * IDs, in order: for each message, its 3 template tokens (IM_START_ID, the role's ID,
    NEWLINE_ID), then the pieces that belong to it. A completions prompt has no
    template tokens (an empty one is the single token EMPTY_PROMPT_ID).
  * A piece's ID = TEXT_ID_BASE + crc32(H) % TEXT_VOCAB, where H is the piece's bytes cut
    at the end of its message, preceded by any bytes of its message (or of earlier
    messages without pieces of their own) that no earlier ID has hashed yet. So no ID
    depends on a later message: a conversation that extends an earlier one (the same
    messages plus new ones at the end) starts with exactly the earlier one's IDs, and
    shares all its full cache blocks when bpt >= 1. (Bytes of trailing messages that own
    no piece affect no ID; their template tokens still count.) With bpt < 1 (more tokens
    than bytes) the count is not additive: the last piece may start at byte N, belong to
    no byte, and go to the last message, so an extended conversation can differ from the
    earlier one in that last ID.
  * Role IDs: ROLE_IDS for the usual roles; any other role string r gets
    ROLE_ID_BASE + 16 + crc32(r) % 240. A message that is not an object has role "".
"""

from __future__ import annotations

import bisect
import math
import zlib
from typing import Any

__all__ = [
    "CHAT_MESSAGE_TOKENS",
    "IM_START_ID",
    "NEWLINE_ID",
    "ROLE_IDS",
    "TEXT_ID_BASE",
    "TEXT_VOCAB",
    "EMPTY_PROMPT_ID",
    "VOCAB_SIZE",
    "prompt_size",
    "prompt_token_ids",
    "role_id",
    "piece_id",
]

CHAT_MESSAGE_TOKENS = 3  # chat-template overhead per message: IM_START_ID, role, NEWLINE_ID

VOCAB_SIZE = 32768  # the mock's vocabulary: every prompt ID is below it
TEXT_ID_BASE = 256  # text piece IDs: TEXT_ID_BASE .. TEXT_ID_BASE + TEXT_VOCAB - 1
TEXT_VOCAB = 32000
EMPTY_PROMPT_ID = 1  # the one token of an empty completions prompt (BOS-like)
IM_START_ID = 32256
NEWLINE_ID = 32257
ROLE_ID_BASE = 32258
ROLE_IDS: dict[str, int] = {
    "system": ROLE_ID_BASE,
    "user": ROLE_ID_BASE + 1,
    "assistant": ROLE_ID_BASE + 2,
    "tool": ROLE_ID_BASE + 3,
    "developer": ROLE_ID_BASE + 4,
    "function": ROLE_ID_BASE + 5,
}


def role_id(role: str) -> int:
    """The template token of a chat role."""
    rid = ROLE_IDS.get(role)
    return rid if rid is not None else ROLE_ID_BASE + 16 + zlib.crc32(role.encode()) % 240


def piece_id(data: bytes) -> int:
    """The ID of a text piece (the bytes it hashes, see the module rules)."""
    return TEXT_ID_BASE + zlib.crc32(data) % TEXT_VOCAB


def _message_text(m: dict[str, Any]) -> bytes:
    parts: list[bytes] = []
    c = m.get("content")
    if isinstance(c, str):
        parts.append(c.encode())
    elif isinstance(c, list):
        parts.extend(p["text"].encode() for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict):
            parts.append(str(fn.get("name") or "").encode())
            parts.append(str(fn.get("arguments") or "").encode())
    return b"".join(parts)


def _segments(route: str, body: dict[str, Any]) -> tuple[list[bytes], list[str] | None]:
    """(text segments, their roles; None: a completions prompt without template)."""
    if route == "chat":
        msgs = body.get("messages") or []
        roles = [str(m.get("role") or "") if isinstance(m, dict) else "" for m in msgs]
        return [_message_text(m) if isinstance(m, dict) else b"" for m in msgs], roles
    p = body.get("prompt")
    if isinstance(p, str):
        return [p.encode()], None
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return ["\n".join(p).encode()], None
    return [], None


def _exact_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    if route == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and all(type(x) is int for x in p):
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            return [x for sub in p for x in sub if type(x) is int]
    return None


def _pieces(nbytes: int, bytes_per_token: float) -> int:
    return math.ceil(nbytes / bytes_per_token)


def prompt_size(route: str, body: dict[str, Any], bytes_per_token: float) -> tuple[int, list[int] | None]:
    """(prompt tokens, the prompt's token IDs when the prompt was given as IDs)."""
    ids = _exact_ids(route, body)
    if ids is not None:
        return len(ids), ids
    segs, roles = _segments(route, body)
    n = _pieces(sum(len(s) for s in segs), bytes_per_token) + CHAT_MESSAGE_TOKENS * (len(roles) if roles is not None else 0)
    return max(n, 1), None


def prompt_token_ids(route: str, body: dict[str, Any], bytes_per_token: float) -> list[int]:
    """The prompt's token IDs; len(...) == prompt_size(...)[0] always."""
    ids = _exact_ids(route, body)
    if ids is not None:
        return ids
    segs, roles = _segments(route, body)
    text = b"".join(segs)
    total = len(text)
    pieces = _pieces(total, bytes_per_token)
    # bounds[k]: piece k's first byte; bounds[pieces] == total (pieces * bpt >= total)
    if float(bytes_per_token).is_integer():
        bounds = list(range(0, total, int(bytes_per_token)))
    else:
        bounds = [min(math.floor(k * bytes_per_token), total) for k in range(pieces)]
    bounds.append(total)
    crc, base, vocab = zlib.crc32, TEXT_ID_BASE, TEXT_VOCAB
    out: list[int] = []
    k = 0  # the next piece
    hashed = 0  # bytes of S some ID has hashed so far
    start = 0  # the current segment's first byte in S
    last = len(segs) - 1
    for i, seg in enumerate(segs):
        if roles is not None:
            out += (IM_START_ID, role_id(roles[i]), NEWLINE_ID)
        end = start + len(seg)
        # the pieces whose first byte is in this segment (the last one takes any left)
        k_end = pieces if i == last else bisect.bisect_left(bounds, end, k, pieces)
        if k < k_end:
            out.append(base + crc(text[hashed : min(bounds[k + 1], end)]) % vocab)
            out += [base + crc(text[bounds[j] : bounds[j + 1]]) % vocab for j in range(k + 1, k_end - 1)]
            if k_end - 1 > k:
                out.append(base + crc(text[bounds[k_end - 1] : min(bounds[k_end], end)]) % vocab)
            hashed = min(bounds[k_end], end)
            k = k_end
        start = end
    return out if out else [EMPTY_PROMPT_ID]
