"""The pause a migrated answer sees at the cut (issue 24 item 2: "P/D: a prefill of the
continuation or a direct decode, say which and measure"): P/D, where the continuation is a
direct decode on the other decode engine (which prefills the token-ID prompt itself), vs
unified, where another unified engine prefills it; the same sequence mocks (20 ms per
token), ~2,000-token prompts, 30 answers each broken at token 30 on d0, one at a time.

    python scripts/bench/migration_pd.py          (from the repository root; ~1 min)

Prints Markdown rows: kind | answers | carried on whole | pause at the cut p50 / p95 / max
ms | token gap p50 ms. Loopback only; the mocks and the router run in this process's
threads and stop with it."""
import statistics
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # tests.helpers
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router, sse

MODEL = "narwhal-demo"
def run(kind: str, n: int = 30) -> tuple[list[float], list[float], int]:
    t = Timing(tpot_base_ms=20.0)
    roles = [("prefill", "p0"), ("decode", "d0"), ("decode", "d1")] if kind == "pd" else [("unified", "d0"), ("unified", "d1")]
    cfg = [MockConfig(dialect="vllm", role=r, model=MODEL, name=nm, timing=t, sequence_output=True) for r, nm in roles]
    gaps, base, whole = [], [], 0
    with running_fleet(cfg) as ms:
        conf = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 100},
                "upstream": {"migration": {"max_attempts": 1}}}
        with running_router(conf, [EngineSpec(m.config.name, m.url, m.config.role, "vllm", None, None) for m in ms]) as rr:
            for i in range(n):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i} " * 1000}], "max_tokens": 60, "ignore_eos": True, "stream": True,
                        "return_token_ids": True, "mock": {"fault": "drop", "fault_after": 30, "fault_engines": ["d0"]}}
                st = sse(rr.url, body)
                a = st.arrivals
                d = [a[k + 1] - a[k] for k in range(len(a) - 1)]
                # events: role, then tokens; the cut is between token 30 and 31 (event index ~30)
                whole += int(st.done and st.comments == ["x-narwhal-migrations 1"])
                gaps.append(max(d[25:40]) * 1000)
                base += [x * 1000 for x in d[5:25]]
    return gaps, base, whole

for kind in ("unified", "pd"):
    g, b, w = run(kind)
    q = statistics.quantiles(g, n=100)
    print(f"| {kind} | {len(g)} | {w} | {statistics.median(g):.0f} / {q[94]:.0f} / {max(g):.0f} | {statistics.median(b):.0f} |")
