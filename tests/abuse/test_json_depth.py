"""Attack: a body that parses but cannot be written again. orjson reads JSON nested 1,024
levels deep but writes only 254, and the router writes every body again for its engines:
a client that nests 254-1,024 levels deep in any pass-through field got a 500
internal_error with a traceback. Defence: the request checks (R04) refuse a body nested
deeper than MAX_DEPTH (253) levels, the body object being level 1, with param naming the
field, before anything is sent upstream."""

from __future__ import annotations

import httpx
import pytest

from narwhal.core.requests import MAX_DEPTH, ParsedRequest, Rejection, parse_request
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.abuse.rawengine import raw_engine
from tests.helpers import running_router

MODEL = "narwhal-demo"
HEAD = '{"model": "narwhal-demo", "messages": '
USER = '[{"role": "user", "content": "hi"}]'

# (field named in param, body template with NEST where the nesting goes, levels above it)
FIELDS = [
    ("foo", HEAD + USER + ', "foo": NEST}', 1),
    ("tools[0].function.parameters", HEAD + USER + ', "tools": [{"type": "function", "function": {"name": "f", "parameters": NEST}}]}', 4),
    ("messages[0].content[0].cache_control", HEAD + '[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": NEST}]}]}', 5),
    ("messages[0].content", HEAD + '[{"role": "user", "content": NEST}]}', 3),
]
DEPTHS = [250, 253, 254, 300, 1024]


def body(template: str, above: int, depth: int, leaf: str = '"x"') -> bytes:
    """The template with arrays nested so that the whole body is `depth` levels deep."""
    n = depth - above
    return template.replace("NEST", "[" * n + leaf + "]" * n).encode()


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(("param", "template", "above"), FIELDS, ids=[f[0] for f in FIELDS])
def test_nesting_past_max_depth_is_R04_naming_the_field(param: str, template: str, above: int, depth: int) -> None:
    got = parse_request("chat", body(template, above, depth), model=MODEL)
    if depth <= MAX_DEPTH:
        if param == "messages[0].content":  # content must be text or parts: R04 for its type
            assert isinstance(got, Rejection) and got.row is E.R04 and "nested deeper" not in str(got.fields)
        else:
            assert isinstance(got, ParsedRequest)
    else:
        assert isinstance(got, Rejection), got
        assert (got.row, got.param) == (E.R04, param)
        assert f"nested deeper than {MAX_DEPTH} levels" in str(got.fields["detail"])


def test_objects_nest_like_arrays() -> None:
    deep = '{"a": ' * 260 + "1" + "}" * 260
    got = parse_request("chat", f'{{"model": "{MODEL}", "messages": {USER}, "foo": {deep}}}'.encode(), model=MODEL)
    assert isinstance(got, Rejection) and got.param == "foo.a.a.a.a.a"


def test_a_long_flat_body_is_not_deep() -> None:
    """Many brackets, little nesting: 2,000 short messages pass."""
    msgs = ", ".join('{"role": "user", "content": [{"type": "text", "text": "m"}]}' for _ in range(2000))
    got = parse_request("chat", f'{{"model": "{MODEL}", "messages": [{msgs}]}}'.encode(), model=MODEL)
    assert isinstance(got, ParsedRequest)


@pytest.mark.parametrize("stream", [False, True])
def test_over_http_a_deep_body_is_400_and_reaches_no_engine(stream: bool) -> None:
    with raw_engine() as eng:
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}}
        with running_router(cfg, [EngineSpec("u0", eng.url, "unified", "vllm", None, None)]) as rr:
            tmpl = HEAD + USER + f', "stream": {"true" if stream else "false"}, "foo": NEST}}'
            for depth in (254, 300, 1024):
                r = httpx.post(rr.url + "/v1/chat/completions", content=body(tmpl, 1, depth), headers={"content-type": "application/json"}, timeout=10)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (err["code"], err["param"]) == (E.R04.code, "foo")
            r = httpx.post(rr.url + "/v1/chat/completions", content=body(tmpl, 1, 253), headers={"content-type": "application/json"}, timeout=10)
            assert r.status_code == 200, r.text
            assert len(eng.posts()) == 1  # only the request that could be written again
            rr.balanced()
