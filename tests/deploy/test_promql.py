"""The PromQL name extractor of tests/deploy/promql.py on expressions built to fool it:
functions, aggregations with clauses either side, label names and values, strings,
ranges, subqueries, offsets, @, numbers in every form, Grafana variables."""

from __future__ import annotations

import pytest

from tests.deploy.promql import dashboard_exprs, metric_names, rule_exprs

CASES = [
    ("up", {"up"}),
    ("narwhal_requests_open > 0", {"narwhal_requests_open"}),
    ('sum by (job, instance) (rate(narwhal_requests_terminal_total{class=~"rejected|refused"}[5m]))', {"narwhal_requests_terminal_total"}),
    ("sum(rate(a_total[5m])) by (job) / ignoring(class) group_left(engine) b", {"a_total", "b"}),
    ('histogram_quantile(0.99, sum without (worker) (rate(narwhal_ttft_seconds_bucket{le!="+Inf"}[$__rate_interval])))', {"narwhal_ttft_seconds_bucket"}),
    ('label_replace(x, "dst", "$1", "src", "(sum|rate)\\\\(y\\\\)")', {"x"}),
    ("rate(x[5m] offset 1h) * on (job) group_right (instance) y @ 1609746000", {"x", "y"}),
    ("max_over_time(deriv(x[10m])[1h:5m])", {"x"}),
    ("a unless on (job, instance) (b == 1) or c and bool d", {"a", "b", "c", "d"}),
    ("x > 1e3 and y < 0x1F and z != Inf and w != NaN and v > 2.5e-3", {"x", "y", "z", "w", "v"}),
    ('count_values("by", x)', {"x"}),
    ('{job="narwhal"} and metric:recorded:rate5m', {"metric:recorded:rate5m"}),
    ('x{instance=~"$instance", job="${job}"} / vector($ttft_budget) + [[legacy]]', {"x"}),
    ("sum by(le)(rate(by_metric_total[1m]))", {"by_metric_total"}),
    ("absent(narwhal_router_state{state=\"active\"}) or time() - timestamp(up)", {"narwhal_router_state", "up"}),
    ("topk(3, sum by (code) (rate(narwhal_refusal_seconds_count[5m])))", {"narwhal_refusal_seconds_count"}),
    ("  rate\n  (\n x_total[1m]\n )", {"x_total"}),
]


@pytest.mark.parametrize(("expr", "names"), CASES, ids=[c[0][:40] for c in CASES])
def test_metric_names_finds_exactly_the_metrics(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_every_dashboard_and_rule_expression_names_a_metric() -> None:
    exprs = dashboard_exprs() + rule_exprs()
    assert len(exprs) > 50
    for where, expr in exprs:
        names = metric_names(expr)
        if expr.strip().startswith("vector("):
            assert names == set(), (where, expr)
            continue
        assert names, (where, expr)
        assert all(n == "up" or n.startswith("narwhal_") for n in names), (where, names)
