"""Fine-tuning reports: the FedNCM paper's Figure 1 (accuracy versus rounds, versus
communication and versus computation, one curve per method) and the stage table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedheads.report import plotting
from fedheads.report import results as report

_PANELS = (("round", "fine-tuning round (0 = after stage 1)", 1.0),
           ("measured_comm_bytes", "communication sent, up + down ({unit}, measured)", 1.0),
           ("paper_compute_F", "client computation (units of F, FedNCM App. A)", 1.0))


def _byte_unit(results: Sequence[Mapping[str, Any]]) -> tuple[str, float]:
    """The unit the communication axis reads best in: its largest value at 1 to 1000 units."""
    top = max((float(p.get("measured_comm_bytes", 0.0)) for r in results for p in r.get("figure1") or []), default=0.0)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if top >= size:
            return unit, size
    return "B", 1.0


def figure1(results: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Three panels from each result's `figure1` curve (mean +-1 std over seeds)."""
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    unit, size = _byte_unit(results)
    panels = [(k, label.format(unit=unit), scale / size if k == "measured_comm_bytes" else scale)
              for k, label, scale in _PANELS]
    for i, r in enumerate(results):
        curve = r.get("figure1") or []
        if not curve:
            continue
        y = np.array([p["accuracy"] for p in curve])
        s = np.array([p.get("std", 0.0) for p in curve])
        for ax, (key, _, scale) in zip(axes, panels):
            x = np.array([p[key] for p in curve], dtype=float) * scale
            ax.plot(x, y, marker="o" if len(x) < 12 else None, label=r["algorithm"], **plotting.style(i))
            ax.fill_between(x, y - s, y + s, color=plotting.color(i), alpha=0.2)
    from matplotlib.ticker import MaxNLocator

    for ax, (_, label, _) in zip(axes, panels):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))  # tick labels that never run into each other
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    axes[2].set_xscale("symlog", linthresh=1.0)
    axes[0].set_ylabel("test accuracy (%), mean over clients")
    plotting.legend_outside(axes[2], source=axes[0])
    fig.suptitle(title or plotting.result_title("Fine-tuning (FedNCM Figure 1)", results))
    return plotting.save(fig, path)


def stages_markdown(result: Mapping[str, Any]) -> str:
    """What each stage did and cost, with the paper-convention figures beside the measured ones."""
    rows = []
    for st in result.get("stages", []):
        acc = st.get("accuracy")
        c = st.get("communication") or {}
        rows.append([st["stage"], str(st.get("method", st.get("trainable", ""))), str(st.get("rounds", "")),
                     "-" if not acc else f"{acc['mean']:.2f}({acc['std']:.2f})",
                     f"{(c.get('upload_bytes_total', 0) + c.get('download_bytes_total', 0)) / 1e6:.3f}" if c else "-"])
    pu = result.get("paper_units", {})
    lines = ["## Stages", "", report._table(["stage", "method / trainable", "rounds", "accuracy (%)",
                                                  "measured comm (MB)"], rows), ""]
    if pu:
        lines += [f"Paper units ({pu.get('reference', '')}): head stage {pu['head_comm_bytes'] / 1e6:.3f} MB, "
                  f"{pu['head_compute_F']:.3g} F; fine-tuning {pu['ft_comm_bytes'] / 1e6:.3f} MB, "
                  f"{pu['ft_compute_F']:.3g} F (P = {pu['P_trained_base_params']:,}, LL = "
                  f"{pu['LL_in']} x {pu['LL_out']}). {pu.get('note', '')}", ""]
    return "\n".join(lines)
