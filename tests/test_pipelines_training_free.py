"""The `training-free` experiments: declared consistently (claims name its methods, the +FT rows say
which form ran), DP cells run under the Gaussian mechanism and record the epsilon spent (CCVR's with
the DP head it calibrates, composed; FedPFT's in local mode), and both experiments run end to end at
smoke scale on the test doubles (a fake Office-10 copy, a tiny backbone)."""

from __future__ import annotations

import collections
import json

import pipelines_doubles as pd
import pytest
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed

# imported before any test here patches `fedheads.run.load.load_fed_data`: a module first imported
# while the patch is on would keep the stand-in (`from ... import load_fed_data`) for later tests
import fedheads.finetuning.heads  # noqa: F401
import fedheads.run.train  # noqa: F401
from pipelines import plan, registry
from pipelines.cli import main


def test_claims_and_rows_name_methods_the_experiment_declares():
    for name in ("training-free", "training-free-dp"):
        exp = registry.get(name)
        for cl in exp.claims:
            for label in (cl.best, *cl.over):
                exp.method(label)  # UserError if a claim names no method
    exp = registry.get("training-free")
    labels = {m.label: m for m in exp.methods}
    for head in ("FedNCM", "Fed3R", "FedCOF", "CCVR (FedAvg-LP)", "FedPFT", "AFL", "GH-OFL LDA", "GH-OFL QDA",
                 "GH-OFL Proto-Hyper", "FedCGS"):
        assert head in labels
    # the full fine-tuning rows run at paper scale; ci/smoke fine-tune the last stage cache-first, labelled so
    ft = [m for m in exp.methods if m.kind == "finetune"]
    full = [m for m in ft if m.scales == ("paper",)]
    cached = [m for m in ft if m.scales == ("smoke", "ci")]
    assert len(full) + len(cached) == len(ft) and all("+FT (10 rounds)" in m.label for m in full)
    assert cached and all("+FT (10 rounds, last stage, cache-first)" in m.label
                          and dict(m.settings).get("trainable") == "after:{cut}" for m in cached)
    from fedheads.run.checks import check_finetune_heads

    for rows in (full, cached):
        check_finetune_heads([m.algorithm for m in rows if not m.requires])  # `fedheads finetune --head` takes them
        assert {m.algorithm for m in rows if not m.requires} == {"fedncm", "fed3r", "fedcof", "afl", "ghofl", "fedcgs"}
    lp = [m for m in exp.methods if "+LP (10 rounds, cached)" in m.label]
    assert {dict(m.settings).get("init") for m in lp} == {"fedncm", "fed3r", "fedcof", "afl", "ghofl", "fedcgs", "fedpft"}
    assert all(m.paper_rounds == 11 for m in lp)  # round 0 is the head, then 10 rounds of tuning


def test_dp_setting_is_a_cell_option_and_changes_the_hash():
    exp = registry.get("training-free-dp")
    ctx = plan.RunContext(scale="ci")
    arms = [a for a in plan.arms(exp, ctx) if a.method.label == "FedNCM"
            and a.point.coord("partition").startswith("feature") and a.point.coord("epsilon") in (1.0, 2.0)]
    for a in arms:  # the configuration needs no data
        a.prepared = _Prepared()
    c1, c2 = (plan.cells(a, ctx)[0]["config"] for a in arms)
    assert [dict(c["options"]["dp"])["epsilon"] for c in (c1, c2)] == [1.0, 2.0]
    assert "dp" not in c1["settings"]["common"] and plan.cell_hash(c1) != plan.cell_hash(c2)


class _Prepared:
    manifest_hash = "m"
    features = {"backbones": {}}
    manifest_path = "unused"
    store = "unused"


@pytest.mark.parametrize("algorithm", ["fedncm", "fed3r"])
def test_a_dp_cell_trains_under_the_mechanism_and_reports_its_epsilon(monkeypatch, algorithm):
    import fedheads.run.load as fd
    import pipelines.cells as cells
    from fedheads import privacy

    data = tiny_fed(M=5, seed=2)
    monkeypatch.setattr(fd, "load_fed_data", lambda *a, **k: data)
    monkeypatch.setattr(cells, "_DATA", collections.OrderedDict())
    cfg = {"algorithm": algorithm, "seed": 0, "backbones": ["b"], "features": {"backbones": {"b": {"dim": data.dim}}},
           "settings": {"common": {}, "method": {}},
           "options": {"rounds": 1, "fraction": 1.0, "device": "cpu", "eval_every": 0}}
    plain = cells.run_head(cfg, {"store": "unused"})
    assert plain["privacy"] is None
    dp = [["epsilon", 1.0], ["delta", 1e-5], ["clip", 1.0], ["transform", "normalize"], ["noise_seed", 0]]
    out = cells.run_head({**cfg, "options": {**cfg["options"], "dp": dp}}, {"store": "unused"})
    p = out["privacy"]
    assert p["mechanism"] == "gaussian" and p["releases_per_example"] == 1 and p["transform"] == "normalize"
    # the epsilon spent is dp-accounting's for the calibrated noise, at most the target
    assert p["epsilon"] == pytest.approx(privacy.epsilon(p["noise_multiplier"], 1e-5, 1, "rdp"))
    assert p["epsilon"] <= 1.0 + 1e-6
    a = torch.tensor(list(plain["seed_result"]["per_client"].values()))
    b = torch.tensor(list(out["seed_result"]["per_client"].values()))
    assert not torch.equal(a, b)  # the noise reached the head


def _dp_cells(label: str, scale: str = "ci") -> list[dict]:
    exp = registry.get("training-free-dp")
    ctx = plan.RunContext(scale=scale)
    arms = [a for a in plan.arms(exp, ctx) if a.method.label == label]
    for a in arms:  # the configuration needs no data
        a.prepared = _Prepared()
    return [(a.point, plan.cells(a, ctx)[0]["config"]) for a in arms]


def test_ccvr_and_fedpft_refine_the_points_mechanism_and_fedncm_cells_are_unchanged():
    from pipelines.exp_training_free import EPSILONS, _dp

    ccvr = _dp_cells("CCVR (on DP Fed3R)")
    assert {p.coord("partition") for p, _ in ccvr} == {"feature shift, 4 domains"}  # [clients, C, D, D] moments
    for p, c in ccvr:  # the point's epsilon, both releases (head and calibration) planned for
        dp = dict(c["options"]["dp"])
        assert dp["epsilon"] == p.coord("epsilon") and dp["releases"] == 2 and dp["transform"] == "normalize"
        assert c["options"]["head_from"] == "fed3r" and c["settings"]["method"] == {"covariance": "paper"}
    pft = _dp_cells("FedPFT (local DP)")
    assert len(pft) == 2 * len(EPSILONS)
    for p, c in pft:
        dp = dict(c["options"]["dp"])
        assert dp["mode"] == "local" and dp["epsilon"] == p.coord("epsilon") and "releases" not in dp
    for p, c in _dp_cells("FedNCM"):  # no method refinement: the point's mechanism as it was (same hashes)
        assert c["options"]["dp"] == _dp(p.coord("epsilon"))[0][1] and "head_from" not in c["options"]


def _head_cell(algorithm: str, data, dp=None, options=None) -> dict:
    return {"algorithm": algorithm, "seed": 0, "backbones": ["b"],
            "features": {"backbones": {"b": {"dim": data.dim}}}, "settings": {"common": {}, "method": {}},
            "options": {"rounds": 1, "fraction": 1.0, "device": "cpu", "eval_every": 0,
                        **({"dp": dp} if dp else {}), **(options or {})}}


def test_ccvr_cell_calibrates_a_dp_fed3r_head_and_accounts_both_releases(monkeypatch, tmp_path):
    import fedheads.run.load as fd
    import pipelines.cells as cells
    from fedheads import privacy

    data = tiny_fed(M=4, seed=2)
    monkeypatch.setattr(fd, "load_fed_data", lambda *a, **k: data)
    monkeypatch.setattr(cells, "_DATA", collections.OrderedDict())
    dp = [["epsilon", 2.0], ["delta", 1e-5], ["clip", 1.0], ["transform", "normalize"], ["noise_seed", 0],
          ["releases", 2]]
    cfg = _head_cell("ccvr", data, dp, {"head_from": "fed3r"})
    out = cells.run_head(cfg, {"store": "unused"}, out=tmp_path / "cell")
    head, own = out["saved_head"], out["privacy"]
    assert head["algorithm"] == "fed3r" and (tmp_path / "cell" / "head" / "results.json").is_file()
    hp = head["privacy"]
    # the same mechanism (z planned for two releases), the head's noise from another key
    assert hp["noise_multiplier"] == own["noise_multiplier"] and hp["noise_seed"] == 1 and own["noise_seed"] == 0
    assert hp["releases_per_example"] == own["releases_per_example"] == 1
    assert own["post_processing"]["calibrated_head_privacy"]["epsilon"] == hp["epsilon"]
    e2e = out["privacy_end_to_end"]
    z = own["noise_multiplier"]
    assert e2e["releases"] == 2 and e2e["epsilon"] == pytest.approx(privacy.epsilon(z, 1e-5, 2, "rdp"))
    assert own["epsilon"] < e2e["epsilon"] <= 2.0 + 1e-6  # one release each; the two compose to the target
    with pytest.raises(ValueError, match="no directory"):
        cells.run_head(cfg, {"store": "unused"})


def test_composed_epsilon_of_different_mechanisms_lies_between_their_self_compositions():
    from fedheads import privacy
    from pipelines.cells import composed_epsilon

    def block(z):
        return {"noise_multiplier": z, "releases_per_example": 1, "delta": 1e-5, "accountant": "rdp"}

    e = composed_epsilon([block(2.0), block(4.0)])
    assert privacy.epsilon(4.0, 1e-5, 2) < e < privacy.epsilon(2.0, 1e-5, 2)
    assert composed_epsilon([block(3.0), block(3.0)]) == pytest.approx(privacy.epsilon(3.0, 1e-5, 2))
    with pytest.raises(ValueError, match="different deltas"):
        composed_epsilon([block(2.0), {**block(2.0), "delta": 1e-6}])


def test_a_fedpft_cell_runs_under_local_dp(monkeypatch):
    import fedheads.run.load as fd
    import pipelines.cells as cells

    data = tiny_fed(M=5, seed=2)
    monkeypatch.setattr(fd, "load_fed_data", lambda *a, **k: data)
    monkeypatch.setattr(cells, "_DATA", collections.OrderedDict())
    dp = [["epsilon", 8.0], ["delta", 1e-5], ["clip", 1.0], ["transform", "normalize"], ["noise_seed", 0],
          ["mode", "local"]]
    p = cells.run_head(_head_cell("fedpft", data, dp), {"store": "unused"})["privacy"]
    assert p["mode"] == "local" and p["releases_per_example"] == 1 and p["epsilon"] <= 8.0 + 1e-6


def test_both_experiments_run_at_smoke_scale_on_the_doubles(tmp_path):
    copy = pd.make_folder(tmp_path / "office", ("amazon", "caltech10", "dslr", "webcam"), tuple("abcde"), per_class=6)
    args = ["run", "training-free", "training-free-dp", "--scale", "smoke", "--plugin", "pipelines_doubles",
            "--source", f"office10=imagefolder:{copy}", "--backbone", "efficientnet-lite0=pl-tiny-a",
            "--scheduler", "serial", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--quiet"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    for name in ("training-free", "training-free-dp"):
        edir = tmp_path / "out" / name
        results = json.loads((edir / "results.json").read_text())
        assert results["cells"] and {c["status"] for c in results["cells"]} == {"done"}
        assert (edir / "figure.png").stat().st_size > 0
    report = (tmp_path / "out" / "training-free" / "report.md").read_text()
    assert "FedCOF above FedNCM" in report and "lp init=fedpft" in report  # claims, and why a row cannot run
    # the cache-first +FT rows on a backbone without trainable() are 'not run', with the reason, not an internal error
    assert "pl-tiny-a: cannot be fine-tuned (it has no trainable()) (trainable=after:{cut})" in report
    # the backbone that ran is named as the user's replacement, not as the experiment's stand-in
    assert "backbones replaced (--backbone): efficientnet-lite0 -> pl-tiny-a" in report
    assert "pl-tiny-a, --backbone pl-tiny-a in place of efficientnet-lite0" in report
    cells_dir = tmp_path / "out" / "cells"
    eps = {json.loads(p.read_text())["result"]["privacy"]["target_epsilon"] for p in cells_dir.glob("*.json")
           if json.loads(p.read_text())["config"]["options"].get("dp")}
    assert eps == {0.5, 1.0, 2.0, 4.0, 8.0}
    recs = [json.loads(p.read_text()) for p in cells_dir.glob("*.json")]
    ccvr = [r["result"] for r in recs if r["labels"]["method"] == "CCVR (on DP Fed3R)"]
    assert len(ccvr) == 5 and all(r["privacy_end_to_end"]["epsilon"] <= r["privacy"]["target_epsilon"] + 1e-6
                                  for r in ccvr)
    pft = [r["result"]["privacy"] for r in recs if r["labels"]["method"] == "FedPFT (local DP)"]
    assert len(pft) == 10 and {p["mode"] for p in pft} == {"local"}


def test_pooled_accuracy_weights_clients_by_their_test_size():
    from pipelines import measures

    seed_result = {"per_client": {"a": 100.0, "b": 50.0, "c": 0.0}, "n_test": {"a": 3, "b": 1, "c": 0}}
    assert measures._pooled(seed_result) == pytest.approx((300.0 + 50.0) / 4)  # c has no test sample
    recs = [{"status": "done", "result": {"seed_result": seed_result}}]
    agg = {"accuracy": {"mean": 75.0, "std": 0.0}}
    assert measures.values(agg, recs, ("acc", "acc_pooled"), {})["acc_pooled"][0] == pytest.approx(87.5)


def test_bar_panels_keep_each_methods_colour_and_the_legend_names_every_method(monkeypatch, tmp_path):
    from pipelines import figures

    kept = {}
    monkeypatch.setattr(figures, "_save", lambda fig, path: kept.setdefault("fig", fig) and path)
    groups = {"label skew": {"A": {"acc": (90.0, 1.0)}, "C": {"acc": (80.0, 1.0)}},
              "feature shift": {"A": {"acc": (91.0, 1.0)}, "B": {"acc": (85.0, 1.0)}, "C": {"acc": (81.0, 1.0)}}}
    figures.fairness_bars(groups, ("acc",), ("Acc",), tmp_path / "f.png", "t")
    ax1, ax2 = kept["fig"].axes[:2]
    colour = [{p.get_label(): p.patches[0].get_facecolor() for p in ax.containers if hasattr(p, "patches")}
              for ax in (ax1, ax2)]
    assert colour[0]["C"] == colour[1]["C"] != colour[1]["B"]  # C is not painted B's colour in the 2nd panel
    assert [t.get_text() for t in ax2.get_legend().get_texts()] == ["A", "C", "B"]


def test_a_curve_over_epsilon_is_one_line_per_method_and_partition(monkeypatch, tmp_path):
    from pipelines import figures, report

    drawn = {}
    monkeypatch.setattr(figures, "lines", lambda series, axis, *a, **k: drawn.update(series=series, axis=axis))
    exp = registry.get("training-free-dp")
    views = [{"method": "FedNCM", "coords": [["partition", part], ["epsilon", e]], "values": {"acc": (acc, 0.5)},
              "backbones": ["efficientnet-lite0"]}
             for part, base in (("label skew", 90.0), ("feature shift", 80.0)) for e, acc in ((1.0, base), (2.0, base + 1))]
    report._figures(exp, views, [], tmp_path)
    assert drawn["axis"] == "epsilon"
    assert drawn["series"] == {"FedNCM (label skew)": [(1.0, 90.0, 0.5), (2.0, 91.0, 0.5)],
                               "FedNCM (feature shift)": [(1.0, 80.0, 0.5), (2.0, 81.0, 0.5)]}


def test_report_header_says_each_method_runs_its_paper_rounds_where_the_scale_sets_none():
    from pipelines.report import _header_lines

    exp = registry.get("training-free")
    assert exp.scale("ci").rounds is None
    head = "\n".join(_header_lines(exp, {"scale": "ci", "scheduler": "serial"}, []))
    assert "None rounds" not in head and "each method its paper rounds" in head
