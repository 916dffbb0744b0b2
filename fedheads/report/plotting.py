"""What every PNG the toolkit writes shares (fedheads reports, fine-tuning, FedDRA, pipelines):
headless matplotlib, atomic writes, one palette of 12 distinct method colours, legends outside
the data, titles naming the dataset and backbone, and a per-client chart that stays readable
from 4 to 100+ clients. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embedcache.atomic import atomic_path

# tab10 plus black and gold: 12 colours no two of which are closer than tab10's own closest
# pair (grey/brown); methods beyond 12 repeat them (line styles then tell them apart).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#000000", "#ffd700")
LINESTYLES = ("-", "--", ":", "-.")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path) -> Path:
    """The figure as a PNG, atomically (legends outside the axes are kept: bbox_inches="tight")."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
        return path
    finally:
        pyplot().close(fig)


def color(i: int) -> str:
    """The i-th method's colour (the same position gets the same colour in every plot)."""
    return PALETTE[i % len(PALETTE)]


def style(i: int) -> dict[str, Any]:
    """Colour and line style of the i-th method: 12 colours, then the colours again dashed, ..."""
    return {"color": color(i), "linestyle": LINESTYLES[(i // len(PALETTE)) % len(LINESTYLES)]}


def legend_outside(ax: Any, source: Any = None, **kw: Any) -> Any:
    """A legend to the right of `ax` (of what `source`, default `ax`, labels), never over the data:
    for a row of panels, pass the last panel as `ax`. None when nothing is labelled."""
    handles, labels = (source or ax).get_legend_handles_labels()
    if not handles:
        return None
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
                     **kw)


def title(what: str, dataset: str | None = None, backbones: Sequence[str] | str | None = None) -> str:
    """"<what>: <dataset>, <backbone(s)>" (the parts that are known)."""
    bb = backbones if isinstance(backbones, str) else " + ".join(backbones or ())
    where = ", ".join(p for p in (dataset, bb) if p)
    return f"{what}: {where}" if where else what


def result_title(what: str, results: Sequence[Mapping[str, Any]]) -> str:
    """A title from results.json dicts (their `dataset` and `backbones`)."""
    r = results[0] if results else {}
    return title(what, r.get("dataset"), r.get("backbones"))


def plot_history(results: Sequence[Mapping[str, Any]], path: str | Path, title_text: str | None = None) -> Path:
    """Accuracy per round, one line per algorithm, shaded +-1 std over seeds."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(results):
        h = r.get("history") or []
        if not h:
            continue
        x = np.array([p["round"] for p in h])
        y = np.array([p["accuracy"] for p in h])
        s = np.array([p.get("std", 0.0) for p in h])
        ax.plot(x, y, marker="o" if len(x) < 3 else None, label=r["algorithm"], **style(i))
        ax.fill_between(x, y - s, y + s, color=color(i), alpha=0.2)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title_text or result_title("Accuracy per round", results), fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return save(fig, path)


# the per-client chart: inches per client and method, clamped so 100+ clients stay one readable figure
_SLOT_IN, _BAR_IN, _MIN_W, _MAX_W, _BARS_UP_TO = 0.15, 0.16, 6.0, 22.0, 30


def client_label_step(n: int, axis_inches: float, fontsize: float) -> int:
    """Show every step-th client name so that the (vertical) names never overlap: a name takes
    about 1.4 x its font size across the axis."""
    fit = max(1, int(axis_inches * 72 / (1.4 * fontsize)))
    return max(1, math.ceil(n / fit))


_CURVES_OVER = 300  # beyond this many clients: one curve per algorithm, clients sorted by accuracy


def _client_mean(r: Mapping[str, Any], c: str) -> float:
    v = r["per_client"].get(c, {}).get("mean")
    return np.nan if v is None else float(v)


def _sorted_curves_figure(results: Sequence[Mapping[str, Any]], clients: Sequence[str],
                          title_text: str | None) -> Any:
    """Many clients: each algorithm's per-client accuracies sorted, against the share of clients
    (an inverse CDF), so thousands of clients are one line each instead of an unreadable row of
    dots and names (and the figure costs one artist per algorithm, not one per client)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for j, r in enumerate(results):
        m = np.array([_client_mean(r, c) for c in clients])
        m = np.sort(m[~np.isnan(m)])
        if m.size:
            ax.plot(np.linspace(0, 100, m.size), m, color=color(j), lw=1.5,
                    label=f"{r['algorithm']} (median {np.median(m):.1f})")
    ax.set_xlim(0, 100)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"clients sorted by accuracy (% of the {len(clients)} clients; those without test samples left out)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title_text or result_title("Accuracy per client", results), fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return fig


def per_client_figure(results: Sequence[Mapping[str, Any]], title_text: str | None = None) -> Any:
    """Per-client accuracy of each algorithm (std over seeds): grouped bars up to 30 clients, a dot
    plot beyond; the width, fonts and the names shown scale with the number of clients. Beyond 300
    clients each algorithm is one curve of its clients sorted by accuracy."""
    plt = pyplot()
    clients = sorted({c for r in results for c in r["per_client"]})
    if len(clients) > _CURVES_OVER:
        return _sorted_curves_figure(results, clients, title_text)
    n, k = len(clients), max(1, len(results))
    width = min(_MAX_W, max(_MIN_W, n * (_SLOT_IN + _BAR_IN * k) if n <= _BARS_UP_TO else n * 0.22))
    fontsize = 9 if n <= 12 else 8 if n <= 30 else 7
    fig, ax = plt.subplots(figsize=(width, 4.2))
    x = np.arange(n)

    def value(r: Mapping[str, Any], c: str, key: str, absent: float) -> float:
        v = r["per_client"].get(c, {}).get(key)
        return absent if v is None else float(v)

    slot = 0.8 / k
    for j, r in enumerate(results):
        m = [value(r, c, "mean", np.nan) for c in clients]
        s = [value(r, c, "std", 0.0) for c in clients]
        offset = (j - (k - 1) / 2) * slot
        if n <= _BARS_UP_TO:
            ax.bar(x + offset, m, slot, yerr=s, capsize=2 if n <= 12 else 0, label=r["algorithm"], color=color(j),
                   hatch=None if j < len(PALETTE) else "//")
        else:
            ax.errorbar(x + offset, m, yerr=s, fmt="o", ms=3, elinewidth=0.6, label=r["algorithm"], color=color(j))
    empty = [i for i, c in enumerate(clients)
             if any(r["per_client"].get(c, {}).get("n_test") == 0 for r in results)]
    for i in empty:  # an empty, labelled slot: the client is there, it has nothing to score
        ax.text(x[i], 0.04, "n/a\n(0 test)" if n <= 30 else "n/a", ha="center", va="bottom",
                fontsize=fontsize, color="0.35", transform=ax.get_xaxis_transform())
    ax.set_xlim(-0.5, n - 0.5)  # keeps a trailing empty slot on the plot
    axis_in = width * 0.85
    flat = max(map(len, clients), default=0) * 0.6 * fontsize / 72 <= 0.95 * axis_in / max(n, 1)
    step = 1 if flat else client_label_step(n, axis_in, fontsize)  # names that do not fit side by side stand up
    ax.set_xticks(x[::step], [clients[i] for i in range(0, n, step)], rotation=0 if flat else 90, fontsize=fontsize)
    ax.set_xticks(np.setdiff1d(x, x[::step]), minor=True)  # every client keeps a tick, named or not
    if step > 1:
        ax.set_xlabel(f"{n} clients in name order, one name in {step} shown", fontsize=fontsize)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title_text or result_title("Accuracy per client", results), fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    legend_outside(ax)
    return fig


def plot_per_client(results: Sequence[Mapping[str, Any]], path: str | Path, title_text: str | None = None) -> Path:
    """Per-client accuracy chart (see :func:`per_client_figure`) written to `path`."""
    return save(per_client_figure(results, title_text), path)
