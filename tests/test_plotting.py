"""Every PNG shares fedheads.report.plotting: 12 distinct method colours, legends outside the data,
titles with dataset and backbone, and a per-client chart readable from 4 to 100 clients and, beyond
300, one sorted curve per method (geometry of the drawn figure, never pixels)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

from fedheads.report import plotting
from pipelines import figures


def _rgb(c: str) -> np.ndarray:
    from matplotlib.colors import to_rgb

    return np.array(to_rgb(c)) * 255


def _result(name: str, clients: list[str], seed: int = 0, dataset: str = "builtin:digits") -> dict:
    rng = np.random.default_rng(seed)
    return {"algorithm": name, "backbones": ["resnet20-cifar10"], "dataset": dataset,
            "per_client": {c: {"mean": float(rng.uniform(20, 90)), "std": 1.0, "n_test": 10} for c in clients},
            "history": [{"round": r, "accuracy": 10.0 * r + seed, "std": 1.0} for r in range(1, 4)]}


def _legend_outside(fig, ax) -> None:
    leg = ax.get_legend()
    assert leg is not None
    r = fig.canvas.get_renderer()
    assert leg.get_window_extent(r).x0 >= ax.get_window_extent(r).x1  # right of the data, not on it


def test_twelve_methods_get_twelve_distinct_colours():
    cols = [plotting.color(i) for i in range(12)]
    closest = min(np.linalg.norm(_rgb(a) - _rgb(b)) for a, b in itertools.combinations(cols, 2))
    assert closest >= 60  # tab10's own closest pair (grey/brown) is 67 apart
    assert plotting.style(12) == {"color": cols[0], "linestyle": "--"}  # the 13th: colours again, dashed


def test_history_plot_uses_the_palette_and_keeps_the_legend_off_the_data(drawn):
    clients = ["c0", "c1"]
    plotting.plot_history([_result(f"m{i}", clients, i) for i in range(12)], "unused.png")
    fig = drawn[0]
    ax = fig.axes[0]
    assert [ln.get_color() for ln in ax.lines] == [plotting.color(i) for i in range(12)]
    _legend_outside(fig, ax)
    assert ax.get_title() == "Accuracy per round: builtin:digits, resnet20-cifar10"
    assert all(float(t).is_integer() for t in ax.get_xticks())  # no round 1.25


@pytest.mark.parametrize("n", [4, 12, 30, 100])
def test_per_client_chart_is_readable_from_4_to_100_clients(drawn, n):
    clients = [f"client-{i:03d}-longname" for i in range(n)]
    plotting.plot_per_client([_result(f"m{i}", clients, i) for i in range(6)], "unused.png")
    fig = drawn[0]
    ax = fig.axes[0]
    r = fig.canvas.get_renderer()
    shown = [t for t in ax.get_xticklabels() if t.get_text()]
    boxes = sorted((t.get_window_extent(r) for t in shown), key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 + 0.5 for a, b in zip(boxes, boxes[1:])), f"{n} clients: tick labels overlap"
    assert len(set(ax.get_xticks()) | set(ax.get_xticks(minor=True))) == n  # every client keeps its tick
    assert fig.get_figwidth() <= 22
    if n <= 12:
        assert len(shown) == n  # few clients: every name is shown
    else:
        assert len(shown) >= min(n, 20)  # many: thinned, but still a usable number of names
    _legend_outside(fig, ax)
    assert "builtin:digits" in ax.get_title() and "resnet20-cifar10" in ax.get_title()


def test_per_client_chart_of_thousands_of_clients_is_one_sorted_curve_per_method(drawn):
    """A real federation's shape (thousands of clients): one line per method over the share of
    clients, its accuracies sorted; clients without a test score are left out of the curve."""
    clients = [f"c{i:05d}" for i in range(2000)]
    results = [_result(f"m{i}", clients, i) for i in range(3)]
    results[0]["per_client"]["c00000"] = {"mean": None, "std": None, "n_test": 0}
    plotting.plot_per_client(results, "unused.png")
    fig = drawn[0]
    ax = fig.axes[0]
    assert len(ax.lines) == 3 and not ax.patches and not ax.get_xticklabels(minor=True)
    for line, r in zip(ax.lines, results):
        y = line.get_ydata()
        want = sorted(v["mean"] for v in r["per_client"].values() if v["mean"] is not None)
        assert list(y) == want and line.get_xdata()[0] == 0 and line.get_xdata()[-1] == 100
    assert len(ax.lines[0].get_ydata()) == 1999
    _legend_outside(fig, ax)
    assert "2000 clients" in ax.get_xlabel()


def test_pipeline_figures_share_palette_and_outside_legends(drawn):
    series = {f"m{i}": [(0.1, 50.0 + i, 1.0), (1.0, 60.0 + i, 1.0)] for i in range(12)}
    figures.lines(series, "alpha", "unused.png", "FedPCL Figure 2: digit5, resnet20-cifar10")
    fig = drawn[-1]
    ax = fig.axes[0]
    assert [ln.get_color() for ln in ax.lines[:12:]] == [plotting.color(i) for i in range(12)]
    _legend_outside(fig, ax)
    pts = [{"round": r, "accuracy": 50.0 + r, "comm_bytes": 1e6 * (r + 1), "compute_F": 10.0 * (r + 1)} for r in range(4)]
    figures.curves({"a": pts, "b": pts}, "unused.png", "t")
    fig = drawn[-1]
    _legend_outside(fig, fig.axes[2])  # one legend, right of the last panel


def test_train_and_compare_record_the_dataset_for_titles(tmp_path):
    from fedheads.cli import main
    from tests.test_fedheads_cli import _write_store

    store = _write_store(tmp_path)
    res = CliRunner().invoke(main, ["compare", "--store", str(store), "--backbones", "synth", "--algorithms",
                                    "fedncm,lp", "--rounds", "1", "--seeds", "0", "--quiet", "--out",
                                    str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    combined = json.loads((tmp_path / "cmp" / "results.json").read_text())
    # a store started by an import names its first file: a title says what the features are of
    assert combined["dataset"] == "import:st.zarr-c0-train.npz"
    assert combined["algorithms"]["lp"]["dataset"] == combined["dataset"]


def test_fine_tuning_figure_reads_its_bytes_in_a_unit_whose_tick_labels_never_overlap(tmp_path, monkeypatch):
    """A few MB of communication on a GB axis gave tick labels 0.0000 0.0025 0.0050 ... running
    into each other: the unit follows the largest value and the ticks are at most a handful."""
    from fedheads.finetuning import plots
    from fedheads.report import plotting

    curve = [{"round": r, "accuracy": 50.0 + r, "std": 0.5, "measured_comm_bytes": 1.3e6 * r,
              "paper_compute_F": 10.0 * r} for r in range(6)]
    kept = {}
    monkeypatch.setattr(plotting, "save", lambda fig, path: kept.setdefault("fig", fig))
    plots.figure1([{"algorithm": "fedncm+ft", "figure1": curve}], tmp_path / "f.png")
    fig = kept["fig"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    middle = fig.axes[1]
    assert "(MB, measured)" in middle.get_xlabel()
    boxes = [t.get_window_extent(renderer) for t in middle.get_xticklabels() if t.get_text()]
    assert 2 <= len(boxes) <= 7
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in middle.get_xticklabels()]
    assert plots._byte_unit([{"figure1": [{"measured_comm_bytes": 2.5e9}]}]) == ("GB", 1e9)
    assert plots._byte_unit([{"figure1": [{"measured_comm_bytes": 0.0}]}]) == ("B", 1.0)
