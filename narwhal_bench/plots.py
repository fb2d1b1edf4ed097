"""PNG plots for sweeps (matplotlib, from the `bench` extra; imported only when plotting)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["overload_plot", "rate_sweep_plot", "peers_plot", "prefix_ttft_plot", "prefix_load_plot"]


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay the figure out, write it as a PNG (its folder made when missing), close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - the bench extra is missing
        raise SystemExit("plots need matplotlib: pip install 'narwhal[bench]'") from e
    return plt


def overload_plot(data: dict[str, Any], path: Path) -> Path:
    """Goodput, refused-or-cut share and TTFT p99 (completed requests) against offered load;
    with a TPOT target, a fourth panel for TPOT p99."""
    plt = _plt()
    pts = data["points"]
    arms = list(dict.fromkeys(p["arm"] for p in pts))
    tpot = bool(data.get("tpot_target_ms"))
    fig, axes = plt.subplots(1, 4 if tpot else 3, figsize=(19 if tpot else 15, 4.4))
    for arm in arms:
        ps = sorted((p for p in pts if p["arm"] == arm), key=lambda p: p["load"])
        x = [p["load"] for p in ps]
        style = "-o" if arm.startswith("narwhal") else "--s"
        axes[0].plot(x, [p["goodput"] for p in ps], style, label=arm)
        axes[1].plot(x, [p["refusal_rate"] + p["error_rate"] for p in ps], style, label=arm)
        axes[2].plot(x, [(p["ttft_p99_admitted"] or float("nan")) * 1000.0 for p in ps], style, label=arm)
        if tpot:
            axes[3].plot(x, [(p["tpot_p99"] or float("nan")) * 1000.0 for p in ps], style, label=arm)
    tgt = data["ttft_target_ms"]
    axes[0].set_title("goodput (share of offered requests meeting the SLO)", fontsize=10)
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].set_title("refused + cut/failed (share of offered)", fontsize=10)
    axes[1].set_ylim(-0.02, 1.02)
    axes[2].set_title("TTFT p99 of completed requests (ms)", fontsize=10)
    axes[2].set_yscale("log")
    axes[2].axhline(tgt, color="grey", lw=0.8, ls=":")
    if tpot:
        axes[3].set_title("TPOT p99 of completed requests (ms)", fontsize=10)
        axes[3].axhline(data["tpot_target_ms"], color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xlabel("offered load (x capacity)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    cap = data["capacity"]["capacity_req_s"]
    fig.suptitle(f"Overload, {data['scenario']}-bound fleet ({data['capacity']['engines']} unified mock engines, capacity {cap:.1f} req/s, TTFT target {tgt:g} ms"
                 + (f", TPOT target {data['tpot_target_ms']:g} ms" if tpot else "") + "; dotted: targets)", fontsize=10)
    return _save(plt, fig, path)


def rate_sweep_plot(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str, ylabel: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xy in series.items():
        xy = sorted(xy)
        ax.plot([x for x, _ in xy], [y for _, y in xy], "-o", label=name)
    ax.set_xlabel("offered req/s")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def peers_plot(data: dict[str, Any], path: Path) -> Path:
    """Router-added TTFT p50/p99 and router CPU per token event, per router and rate."""
    plt = _plt()
    runs = data["runs"]
    keys = list(runs)
    labels = [k.replace("/h1/", " h1 @").replace("/h2/", " h2 @") + "/s" for k in keys]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(keys) + 1.8))
    y = range(len(keys))
    p50 = [max(0.0, (runs[k]["peer"].get("added_p50") or 0.0) * 1000.0) for k in keys]
    p99 = [max(0.0, (runs[k]["peer"].get("added_p99") or 0.0) * 1000.0) for k in keys]
    axes[0].barh([i + 0.2 for i in y], p99, height=0.4, label="added TTFT p99", color="#f4a261")
    axes[0].barh([i - 0.2 for i in y], p50, height=0.4, label="added TTFT p50", color="#2a9d8f")
    axes[0].set_xscale("symlog", linthresh=1.0)
    axes[0].set_xlabel("ms (routed minus direct)")
    axes[0].legend(fontsize=8)
    axes[1].barh(list(y), [runs[k]["peer"]["cpu_us_per_token"] for k in keys], color="#264653")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("router CPU µs per relayed token event")
    for ax in axes:
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    axes[1].set_yticklabels([])
    fig.suptitle("Routers in front of the same mock engine, same arrivals", fontsize=10)
    return _save(plt, fig, path)


def prefix_ttft_plot(points: Sequence[dict[str, Any]], path: Path, *, budget_ms: int, title: str) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for p in points:
        xs = [t * 1000.0 for t in p["ttfts"]]
        n = p["summary"]["offered"]
        if not xs:
            continue
        style = "-" if p["arm"].startswith("narwhal") else "--"
        lab = f"{p['arm']} (hit {p['mocks']['hit_rate']:.2f}, goodput {p['summary']['goodput']:.2f})"
        # left: CDF over answered requests; right: share of OFFERED requests answered by t
        axes[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, label=lab)
        axes[1].plot(xs, [(i + 1) / n for i in range(len(xs))], style, label=p["arm"])
    for ax in axes:
        ax.axvline(budget_ms, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log)")
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.01, 1.01)
    axes[0].set_title("TTFT CDF of answered requests", fontsize=10)
    axes[1].set_title("share of offered requests answered within TTFT (right end: answered share)", fontsize=10)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title + f"; dotted: TTFT budget {budget_ms} ms", fontsize=10)
    return _save(plt, fig, path)


def prefix_load_plot(datas: Sequence[dict[str, Any]], path: Path) -> Path:
    """Hit rate, TTFT p90 (answered) and goodput against the offered prefill load (rho of
    the replay without any cache), one line per arm, from several runs' prefix.json."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    arms: dict[str, list[tuple[float, float, float, float]]] = {}
    for d in datas:
        rho = d["workload"]["rho_uncached"]
        for p in d["points"]:
            arms.setdefault(p["arm"], []).append((rho, p["mocks"]["hit_rate"], (p["summary"]["ttft"]["p90"] or float("nan")) * 1000.0, p["summary"]["goodput"]))
    for arm, pts in arms.items():
        pts.sort()
        style = "-o" if arm.startswith("narwhal") else "--s"
        for i, ax in enumerate(axes):
            ax.plot([x[0] for x in pts], [x[i + 1] for x in pts], style, label=arm)
    budget = datas[0]["args"]["budget_ms"] if datas else None
    axes[0].set_title("hit rate (mocks: cached / prompt tokens)", fontsize=10)
    axes[1].set_title("TTFT p90 of answered requests (ms, log)", fontsize=10)
    axes[1].set_yscale("log")
    if budget:
        axes[1].axhline(budget, color="grey", lw=0.8, ls=":")
    axes[2].set_title("goodput (offered requests answered within the budget)", fontsize=10)
    axes[2].set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.set_xlabel("offered prefill load without cache (rho)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)
