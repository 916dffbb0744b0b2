"""PNG figures in the papers' forms: accuracy against a grid axis (FedPCL Figure 2), accuracy
against rounds / communication / computation (FedNCM Figure 1), fairness bars (FedPCL Tables
12-13), a learning-rate grid (FedNCM Figure 5), and ours against the published values."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedheads.report.plotting import color, legend_outside, style
from fedheads.report.plotting import pyplot as _pyplot
from fedheads.report.plotting import save as _save


def lines(series: dict[str, list[tuple[Any, float, float]]], xlabel: str, path: Path, title: str,
          published: dict[str, list[tuple[Any, float]]] | None = None) -> Path:
    """One line per method over a grid axis (mean +- std over seeds); published points hollow."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs_all = sorted({x for pts in series.values() for x, _, _ in pts}, key=float)
    numeric_log = all(float(x) > 0 for x in xs_all) and len(xs_all) > 1 and max(map(float, xs_all)) / min(
        map(float, xs_all)) >= 10
    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(pts, key=lambda p: float(p[0]))
        x = np.array([float(p[0]) for p in pts])
        y, s = np.array([p[1] for p in pts]), np.array([p[2] for p in pts])
        ax.plot(x, y, marker="o", label=name, **style(i))
        ax.fill_between(x, y - s, y + s, color=color(i), alpha=0.2)
        for px, py in (published or {}).get(name, []):
            ax.plot([float(px)], [py], marker="o", mfc="none", color=color(i), ms=9)
    if numeric_log:
        ax.set_xscale("log")
        ax.minorticks_off()  # the grid values are the ticks; log minor labels would print over them
    ax.set_xticks([float(x) for x in xs_all], [str(x) for x in xs_all])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(wrap_title(title, 5.5, 10), fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return _save(fig, path)


def curves(per_method: dict[str, list[dict[str, float]]], path: Path, title: str) -> Path:
    """FedNCM Figure 1: accuracy vs rounds, vs cumulative communication (GB), vs computation (F)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, (name, pts) in enumerate(per_method.items()):
        if not pts:
            continue
        r = np.array([p["round"] for p in pts])
        acc = np.array([p["accuracy"] for p in pts])
        comm = np.array([p["comm_bytes"] for p in pts]) / 1e9
        comp = np.array([p["compute_F"] for p in pts])
        marker = "o" if len(pts) < 3 else None
        axes[0].plot(r, acc, marker=marker, label=name, **style(i))
        if np.isfinite(comm).any():
            axes[1].plot(comm, acc, marker=marker, label=name, **style(i))
        if np.isfinite(comp).any():
            axes[2].plot(comp, acc, marker=marker, label=name, **style(i))
    labels = ("round", "communication (GB; App. A Eq. 3-4, adapters: as sent)", "computation (F, App. A Eq. 5-6)")
    for ax, xl in zip(axes, labels):
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        if ax.lines:
            ax.set_xscale("log")
            from matplotlib.ticker import NullFormatter

            ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels overlap on short ranges
    legend_outside(axes[2], source=axes[0])
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def fairness_bars(groups: dict[str, dict[str, dict[str, tuple[float, float]]]], metrics: Sequence[str],
                  headers: Sequence[str], path: Path, title: str) -> Path:
    """One panel per group (e.g. 40 / 80 clients): bars per fairness metric, one colour per method."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(6 * max(1, len(groups)), 3.8), squeeze=False)
    # a method keeps its colour in every panel, and the legend names every method of any panel
    names = list(dict.fromkeys(m for by_method in groups.values() for m in by_method))
    handles: dict[str, Any] = {}
    for ax, (gname, by_method) in zip(axes[0], groups.items()):
        x = np.arange(len(metrics))
        w = 0.8 / max(1, len(by_method))
        for j, (mname, vals) in enumerate(by_method.items()):
            m = [vals.get(k, (np.nan, 0.0))[0] for k in metrics]
            s = [vals.get(k, (np.nan, 0.0))[1] for k in metrics]
            handles[mname] = ax.bar(x + (j - (len(by_method) - 1) / 2) * w, m, w, yerr=s, capsize=2, label=mname,
                                    color=color(names.index(mname)))
        ax.set_xticks(x, headers, rotation=20)
        ax.set_title(gname, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    if handles:
        axes[0][-1].legend([handles[n] for n in names if n in handles], [n for n in names if n in handles],
                           loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def grid(cells: dict[tuple[Any, Any], float], xs: Sequence[Any], ys: Sequence[Any], xlabel: str, ylabel: str,
         path: Path, title: str) -> Path:
    """A heat map of final accuracy over two learning rates (FedNCM Figure 5)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2, 0.8 * len(ys) + 1.5))
    a = np.array([[cells.get((x, y), np.nan) for x in xs] for y in ys], dtype=float)
    im = ax.imshow(a, cmap="viridis", aspect="auto")
    for i in range(len(ys)):
        for j in range(len(xs)):
            if np.isfinite(a[i, j]):
                ax.text(j, i, f"{a[i, j]:.1f}", ha="center", va="center", color="w", fontsize=8)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(wrap_title(title, 1.2 * len(xs) + 1, 10), fontsize=10)
    return _save(fig, path)


def paper_vs_ours(pairs: Sequence[tuple[str, float, float, float, str]], path: Path, title: str) -> Path:
    """Ours (y, with std) against the published value (x), one colour per method (legend outside);
    the diagonal is agreement. The title wraps to the figure's width."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 4.6))
    x = np.array([p[1] for p in pairs])
    y = np.array([p[2] for p in pairs])
    methods = list(dict.fromkeys(p[4] for p in pairs))
    for i, name in enumerate(methods):
        sel = [p for p in pairs if p[4] == name]
        ax.errorbar([p[1] for p in sel], [p[2] for p in sel], yerr=[p[3] for p in sel], fmt="o", ms=4, alpha=0.8,
                    color=color(i), label=name)
    lo, hi = float(min(x.min(), y.min())) - 2, float(max(x.max(), y.max())) + 2
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=1, ls="--")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published (%)")
    ax.set_ylabel("ours (%)")
    ax.set_title(wrap_title(title, 4.8, 10), fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return _save(fig, path)


def wrap_title(title: str, width_in: float, fontsize: float) -> str:
    """`title` broken into lines that fit `width_in` inches at `fontsize` (about 0.55 em a character)."""
    import textwrap

    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.wrap(title, chars, break_on_hyphens=False))
