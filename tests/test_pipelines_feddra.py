"""FedDRA's experiments call the public `fedheads.feddra`: in a build without it they fail with one
clear line (and their report still shows the published values); with it, each cell is the call a
user would make (recorded as its command line), and its results.json becomes the cell's result."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pipelines_doubles as pd
import pytest
from click.testing import CliRunner

import fedheads
from pipelines import plan, registry
from pipelines.cells import FEDDRA_MISSING
from pipelines.cli import main

ENCODERS = ["--backbone", "efficientnet-lite0=pl-tiny-a", "--backbone", "minilm-l6-v2=pl-tiny-b"]


@pytest.fixture
def without_feddra(monkeypatch):
    monkeypatch.delattr(fedheads, "feddra")


def test_without_the_command_feddra_experiments_fail_in_one_line(without_feddra, tmp_path):
    arms = plan.arms(registry.get("feddra-table8"), plan.RunContext(scale="ci"))
    assert arms and {a.unavailable for a in arms} == {FEDDRA_MISSING}
    res = CliRunner().invoke(main, ["run", "feddra-table8", "--scale", "smoke", "--out", str(tmp_path), "--quiet"])
    assert res.exit_code == 1, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: feddra-table8: {FEDDRA_MISSING}"] and "Traceback" not in res.output
    report = (tmp_path / "feddra-table8" / "report.md").read_text()
    assert FEDDRA_MISSING in report and "| 30.20 |" not in report  # no number of ours is made up
    assert "FedDRA Table 8, row '0.1 FedDRA (Ours)'" in report  # the published values, with provenance


def _fake_feddra(calls: list[dict[str, str | bool]],
                 results: Callable[[dict[str, str | bool]], dict]) -> Callable[..., dict]:
    """Stands in for `fedheads.feddra`: records its arguments as the command line's options would
    read ({--option: value}; each setting KEY: VALUE as text) and writes `results(options)` as the
    run's results.json (contract 6)."""

    def feddra(manifest: str, image: str, text: str, out: Path, **kw: object) -> dict:
        opts: dict[str, str | bool] = {"--manifest": str(manifest), "--image-encoder": image, "--text-encoder": text,
                                       "--baseline": ",".join(kw["baselines"]), "--rounds": str(kw["rounds"]),
                                       "--seeds": ",".join(map(str, kw["seeds"])), "--quiet": not kw.get("progress")}
        if kw.get("resume"):
            opts["--resume"] = True
        opts.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in kw["settings"].items()})
        calls.append(opts)
        Path(out).mkdir(parents=True, exist_ok=True)
        res = results(opts)
        (Path(out) / "results.json").write_text(json.dumps(res))
        return res

    feddra.__signature__ = inspect.signature(fedheads.api.feddra)  # type: ignore[attr-defined]  # the keywords it takes
    return feddra


def _opts(call: dict[str, str | bool]) -> dict[str, str | bool]:
    return call


def _results(means: list[float], accuracy: float, **more: object) -> dict:
    """A FedDRA results.json of five mimic clients with these mean R@1s (and `more` keys)."""
    per_client = {f"c{i}": {"mean": m, "n_test": 4} for i, m in enumerate(means)}
    return {"per_client": per_client, "clients": list(per_client), "domains": ["mimic"] * len(means),
            "history": [{"round": 1, "accuracy": accuracy}], **more}


def _run_with_stand_in(monkeypatch, tmp_path: Path, experiment: str,
                       results: Callable[[dict[str, str | bool]], dict]) -> tuple[list[dict], Path]:
    """`pipelines run EXPERIMENT` at smoke scale on a small captioned folder, `fedheads.feddra`
    stood in for by `_fake_feddra(results)`: (the options it got, the experiment's output folder)."""
    calls: list[dict] = []
    monkeypatch.setattr(fedheads, "feddra", _fake_feddra(calls, results))
    copy = pd.make_folder(tmp_path / "pairs", ("mimic",), tuple("abcde"), per_class=8)
    res = CliRunner().invoke(main, ["run", experiment, "--scale", "smoke", "--scheduler", "serial", "--quiet",
                                    "--plugin", "pipelines_doubles", "--source",
                                    f"mimic-cxr=captioned:imagefolder:{copy}", "--out", str(tmp_path / "out"),
                                    *ENCODERS])
    assert res.exit_code == 0, res.output
    return calls, tmp_path / "out" / experiment


def test_each_cell_is_a_feddra_call(monkeypatch, tmp_path):
    def by_rho(opts: dict[str, str | bool]) -> dict:
        rho = float(str(opts["rho"]))
        return _results([20.0 + 10 * rho + i for i in range(5)], 22.0 + 10 * rho, retrieval={
            "t2i_r5": {"mean": {"mean": 50.0 + rho, "std": 0.0}, "worst": {"mean": 40.0, "std": 0.0}}})

    calls, out = _run_with_stand_in(monkeypatch, tmp_path, "feddra-table8", by_rho)
    assert len(calls) == 3  # rho in {0.01, 0.1, 1.0}, one seed at smoke
    for argv in calls:
        opts = _opts(argv)
        assert (opts["--baseline"], opts["--image-encoder"], opts["--text-encoder"], opts["--rounds"],
                opts["--seeds"]) == ("feddra", "pl-tiny-a", "pl-tiny-b", "1", "0")
        assert opts["--quiet"] is True and "--resume" not in opts  # a fresh cell starts afresh
        assert json.loads(Path(str(opts["--manifest"])).read_text())["classes"] == list("abcde")
    assert sorted(float(str(_opts(a)["rho"])) for a in calls) == [0.01, 0.1, 1.0]
    results = json.loads((out / "results.json").read_text())
    r1 = {a["point"]: a["values"]["r1"]["mean"] for a in results["arms"]}
    assert r1 == pytest.approx({"rho=0.01": 22.1, "rho=0.1": 23.0, "rho=1.0": 32.0})  # mean client R@1
    assert {a["point"]: a["values"]["r5"]["mean"] for a in results["arms"]} == \
        pytest.approx({"rho=0.01": 50.01, "rho=0.1": 50.1, "rho=1.0": 51.0})


def test_a_cell_hash_follows_what_its_preset_sets(monkeypatch):
    """A FedDRA cell's hash covers what its --baseline preset sets, so a preset that changes meaning
    (fedavg: two-stage, then the paper's one stage) never reuses the cells of the old one."""
    from fedheads.alignment import runner as feddra_runner
    from pipelines.prepare import Prepared

    exp = registry.get("feddra-table2")
    ctx = plan.RunContext(scale="smoke")
    arm = next(a for a in plan.arms(exp, ctx) if a.method.algorithm == "fedavg")
    arm.prepared = Prepared(manifest_path=Path("m.json"), manifest_hash="0" * 64, store=None, features={}, clients=[])
    now = plan.cells(arm, ctx)[0]
    assert now["config"]["preset"] == {"mu": 0.0, "rho": 0.0, "two_stage": False}
    monkeypatch.setitem(feddra_runner.BASELINES, "fedavg", {"mu": 0.0, "rho": 0.0})  # the old meaning
    assert plan.cells(arm, ctx)[0]["hash"] != now["hash"]


def test_table2_compares_the_published_fedavg_with_the_one_stage_fedavg_and_shows_the_two_stage_beside(
        monkeypatch, tmp_path):
    """Table 2's FedAvg is the paper's one-stage FedAvg (--baseline fedavg); FedAvg with FedDRA's
    two-stage schedule runs beside it as a row of its own that no published number is compared with."""
    r1 = {"feddra": 30.0, "fedavg": 20.0, "fedavg-two-stage": 28.0}  # every client's text->image R@1, by preset

    def by_preset(opts: dict[str, str | bool]) -> dict:
        v = r1[str(opts["--baseline"])]
        return _results([v] * 5, v)

    calls, out = _run_with_stand_in(monkeypatch, tmp_path, "feddra-table2", by_preset)
    assert sorted(str(_opts(a)["--baseline"]) for a in calls) == ["fedavg", "fedavg-two-stage", "feddra"]
    results = json.loads((out / "results.json").read_text())
    ours = {a["method"]: a["values"]["r1"]["mean"] for a in results["arms"] if a["values"]}
    assert ours == pytest.approx({"FedDRA (Ours)": 30.0, "FedAvg": 20.0, "FedAvg (two-stage schedule)": 28.0})
    report = (out / "report.md").read_text()
    # the published FedAvg R@1 (28.8) sits beside the one-stage run's 20.00, never beside the two-stage's 28.00
    assert "| FedDRA Table 2, row 'ConVIRT FedAvg', column 'Rec.@1' | 28.80(0.00) | 20.00(0.00) |" in report
    assert "28.00(0.00) |" not in report.split("## Published values beside ours", 1)[1].split("\n## ", 1)[0]
    assert "| ConVIRT | FedAvg (two-stage schedule) | " in report
    assert "compared with 'FedAvg', the paper's one-stage FedAvg" in report


def test_ci_and_smoke_run_the_quick_presets_local_work_and_paper_scale_the_papers(monkeypatch, tmp_path):
    """A ci cell of the paper's local work (E = 50, both encoders trained) took hours on 2 CPU cores;
    ci and smoke run the `quick` preset's (E = 5 at B = 32, text frozen in stage 2), as --set options
    each cell's command line carries, and paper scale adds none."""
    from fedheads.alignment.runner import PRESETS
    from pipelines.exp_feddra import CPU_LOCAL_WORK

    quick = {k: v for k, v in PRESETS["quick"].items() if k != "rounds"}
    assert dict(CPU_LOCAL_WORK) == quick
    exp = registry.get("feddra-table2")
    assert exp.scale("ci").rounds == PRESETS["quick"]["rounds"] and dict(exp.scale("ci").settings) == quick
    paper = [a for a in plan.arms(exp, plan.RunContext(scale="paper")) if a.method.algorithm == "feddra"]
    assert paper and not set(quick) & set(paper[0].settings)
    calls, _ = _run_with_stand_in(monkeypatch, tmp_path, "feddra-table2", lambda opts: _results([10.0] * 5, 10.0))
    assert calls and all({k: _opts(a)[k] for k in quick} == {k: str(v) for k, v in quick.items()} for a in calls)
