"""results.json summary, paper-style Markdown tables and PNG plots."""

from __future__ import annotations

import json

import pytest

from embedcache.errors import UserError
from fedheads.report import results as R


def _seeds():
    led = {"upload_params_per_client_per_round": 2560.0, "upload_bytes_total": 10240 * 4,
           "download_bytes_total": 10240 * 4}
    return [
        {"seed": 0, "per_client": {"MNIST": 80.0, "SVHN": 20.0}, "communication": led,
         "history": [{"round": 1, "accuracy": 40.0}, {"round": 2, "accuracy": 50.0}],
         "trainable_params_per_client": 131_072},
        {"seed": 1, "per_client": {"MNIST": 84.0, "SVHN": 16.0}, "communication": led,
         "history": [{"round": 1, "accuracy": 44.0}, {"round": 2, "accuracy": 50.0}],
         "trainable_params_per_client": 131_072},
    ]


def test_summarise_runs_contract_keys_and_values():
    r = R.summarise_runs(_seeds(), algorithm="fedpcl", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    for k in ("algorithm", "backbones", "rounds", "seeds", "accuracy", "per_client", "fairness",
              "communication", "trainable_params_per_client",
              "paper_trainable_params_per_client", "history"):
        assert k in r
    assert r["accuracy"] == {"mean": 50.0, "std": 0.0}
    r2 = 2 ** 0.5  # sample std (ddof=1) of two values 4 apart: 4 / sqrt(2)
    assert r["per_client"]["MNIST"] == {"mean": 82.0, "std": pytest.approx(2 * r2)}
    assert r["std_ddof"] == 1 and "ddof=1" in r["std_convention"]
    assert r["fairness"]["worst_10"] == 18.0 and r["fairness"]["best_10"] == 82.0
    assert r["fairness"]["variance"] == 32.0      # population std of (80,20)=30, of (84,16)=34
    c = r["communication"]
    assert c["paper_comm_params_per_client_per_round"] == 2_560
    # FedPCL, 2 clients, 2 rounds: up 2560 per round; down (2+1) x 2560 in round 1 only
    assert c["paper_upload_bytes"] == 2560 * 2 * 2 * 4
    assert c["paper_download_bytes"] == 3 * 2560 * 2 * 1 * 4
    assert c["paper_total_bytes"] == c["paper_upload_bytes"] + c["paper_download_bytes"]
    assert c["upload_params_per_client_per_round"] == 2560.0
    assert r["paper_trainable_params_per_client"] == 133_632   # FedPCL Table 14, K=1
    assert r["history"] == [{"round": 1, "accuracy": 42.0, "std": pytest.approx(2 * r2)},
                            {"round": 2, "accuracy": 50.0, "std": 0.0}]
    r0 = R.summarise_runs(_seeds(), algorithm="fedpcl", backbones=["a"], rounds=2, ddof=0)
    assert r0["per_client"]["MNIST"]["std"] == 2.0 and r0["std_ddof"] == 0
    json.dumps(r)  # JSON-able


def test_fedncm_counts_one_round():
    r = R.summarise_runs(_seeds(), algorithm="fedncm", backbones=["a"], rounds=50,
                         feature_dims=[512], num_classes=10)
    assert r["communication"]["paper_total_bytes"] == 2 * 5120 * 2 * 1 * 4


def test_summarise_runs_rejects_empty():
    with pytest.raises(UserError, match="no seed"):
        R.summarise_runs([], algorithm="x", backbones=[], rounds=1)
    with pytest.raises(UserError, match="seed #0"):
        R.summarise_runs([{"seed": 0}], algorithm="x", backbones=[], rounds=1)


def test_comparison_markdown_layout():
    a = R.summarise_runs(_seeds(), algorithm="FedAvg", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    b = R.summarise_runs(_seeds(), algorithm="Solo", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    md = R.comparison_markdown([a, b], clients=["MNIST", "SVHN"])
    lines = md.splitlines()
    assert lines[0] == ("| Method | MNIST | SVHN | Avg | # of Comm Params |"
                        " Measured upload/client/round |")
    assert lines[2] == "| FedAvg | 82.00(2.83) | 18.00(2.83) | 50.00(0.00) | 133,632 | 2,560 |"
    assert lines[3].endswith("| - | 2,560 |")   # Solo: "-" as printed; measured kept apart
    assert "| Method | Average | Worst 10% |" in md
    assert "sample std (ddof=1" in md  # the report states its std convention
    assert "max(1, floor(q n)) clients" in md  # and how a fraction of few clients is rounded


def test_writers_produce_files(tmp_path):
    a = R.summarise_runs(_seeds(), algorithm="fedpcl", backbones=["a"], rounds=2)
    paths = R.write_comparison([a], tmp_path / "cmp")
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    assert paths["history_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    j = R.write_results_json(a, tmp_path / "results.json")
    assert json.loads(j.read_text())["algorithm"] == "fedpcl"
    md = R.run_markdown(a)
    assert "# fedpcl on a" in md and "50.00(0.00)" in md
    assert not list(tmp_path.rglob("*.tmp"))


def test_seed_result_from_engine_run():
    import numpy as np

    from fedheads.algorithms.fedncm import FedNCM
    from fedheads.core import engine
    from fedheads.run.load import from_arrays

    rng = np.random.default_rng(0)
    clients = []
    for _ in range(3):
        y = np.array([0, 1, 2, 0, 1, 2])
        x = (np.eye(3)[y] * 4 + rng.normal(size=(6, 3)) * 0.1).astype(np.float32)
        clients.append((x, y, x[:4], y[:4]))
    data = from_arrays(clients, 3, client_names=["a", "b", "c"])
    run = engine.run(FedNCM(), data, rounds=1, progress=False)
    s = R.seed_result_from_run(run, 7, data.client_names)
    assert s["per_client"] == {"a": 100.0, "b": 100.0, "c": 100.0}
    assert s["history"] == [{"round": 1, "accuracy": 100.0, "clients_seen": 3}]
    assert s["communication"]["upload_params_per_client_per_round"] == 3 * 3 + 3
    assert s["communication"]["upload_bytes_total"] == 3 * (8 * 9 + 8 * 3)
    r = R.summarise_runs([s], algorithm="fedncm", backbones=["x"], rounds=1,
                         feature_dims=[3], num_classes=3)
    assert r["communication"]["paper_comm_params_per_client_per_round"] == 9
    assert r["trainable_params_per_client"] == 0
    with pytest.raises(UserError, match="2 names for 3 clients"):
        R.seed_result_from_run(run, 7, ["a", "b"])


def test_a_client_without_test_samples_is_kept_and_footnoted(tmp_path):
    seeds = _seeds()
    for s in seeds:
        s["clients_without_test"] = ["USPS"]
        s["n_test"] = {"MNIST": 10, "SVHN": 5, "USPS": 0}
    r = R.summarise_runs(seeds, algorithm="fedpcl", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    assert r["per_client"]["USPS"] == {"mean": None, "std": None, "n_test": 0}
    assert r["per_client"]["MNIST"] == {"mean": 82.0, "std": pytest.approx(2 ** 1.5), "n_test": 10}  # ddof=1
    assert r["clients_without_test"] == ["USPS"]
    assert r["accuracy"] == {"mean": 50.0, "std": 0.0}  # over MNIST and SVHN only
    assert r["fairness"]["worst_10"] == 18.0
    # all three clients communicate: FedPCL Table 2 bytes count them; up C*d per client and round,
    # down (m+1)*C*d in every round after the collection round
    assert r["communication"]["paper_upload_bytes"] == 2560 * 3 * 2 * 4
    assert r["communication"]["paper_download_bytes"] == (3 + 1) * 2560 * 3 * 1 * 4
    md = R.comparison_markdown([r])
    assert md.splitlines()[2].startswith("| fedpcl | 82.00(2.83) | 18.00(2.83) | n/a (0 test) | 50.00(0.00) |")
    note = ("n/a (0 test): USPS has no test samples; Avg and fairness are over the 2 clients "
            "with test samples.")
    assert md.count(note) == 1 and R.run_markdown(r).count(note) == 1
    assert "| USPS | n/a (0 test) |" in R.run_markdown(r)
    from fedheads.report import plotting

    png = plotting.plot_per_client([r], tmp_path / "pc.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(r)


def test_no_client_with_test_samples_is_named():
    with pytest.raises(UserError, match=r"seed #0: no client has test samples \(e.g. a: 0\)"):
        R.summarise_runs([{"seed": 0, "per_client": {}, "clients_without_test": ["a", "b"]}],
                         algorithm="x", backbones=[], rounds=1)


def test_one_seed_shows_n1_not_a_zero_spread_and_headings_name_the_seeds():
    one = R.summarise_runs(_seeds()[:1], algorithm="fedavg", backbones=["a"], rounds=2)
    two = R.summarise_runs(_seeds(), algorithm="fedavg", backbones=["a"], rounds=2)
    assert one["accuracy_cell"] == "50.00 (n=1)" and two["accuracy_cell"] == "50.00(0.00)"
    md = R.comparison_markdown([one], title="a on digits: 2 rounds")
    assert "(0.00)" not in md and "| fedavg | 80.00 (n=1) | 20.00 (n=1) | 50.00 (n=1) |" in md
    assert md.splitlines()[0] == "## a on digits: 2 rounds, seed 0 (n=1)"
    assert "Cells: seed 0 (n=1), so no spread over seeds." in md
    assert R.comparison_markdown([two], title="t").splitlines()[0] == "## t, seeds 0, 1"
    assert "over seeds 0, 1" in R.comparison_markdown([two])  # the console table (no heading) too
    run = R.run_markdown(one)
    assert run.splitlines()[0] == "# fedavg on a: 2 rounds, seed 0 (n=1)" and "(0.00)" not in run
    assert R.run_markdown(two).splitlines()[0] == "# fedavg on a: 2 rounds, seeds 0, 1"


def test_paths_in_reports_are_relative_to_the_run_directory(tmp_path):
    run = tmp_path / "runs" / "cmp"
    text = f"tiny on imagefolder:{tmp_path}/data/office and captioned:imagefolder:{run}/x"
    assert R.relative_paths(text, run) == "tiny on imagefolder:../../data/office and captioned:imagefolder:x"
    assert R.relative_paths("builtin:digits", run) == "builtin:digits"


def test_a_comparison_report_names_no_absolute_path(tmp_path):
    """The store's source is an image folder given by its absolute path: the report written into
    the run directory shows it relative to that directory."""
    from store_doubles import make_imagefolder, make_manifest

    import embedcache
    import fedheads
    from embedcache.manifest import save_manifest

    images = make_imagefolder(tmp_path / "data" / "img", per_class=3)
    save_manifest(make_manifest(images), tmp_path / "m.json")
    embedcache.extract(tmp_path / "m.json", "tiny", tmp_path / "s.zarr", progress=False, num_workers=1)
    out = tmp_path / "runs" / "cmp"
    fedheads.compare(tmp_path / "s.zarr", ["fedncm", "lp"], backbones="tiny", rounds=1, seeds=0, out=out)
    md = (out / "summary.md").read_text()
    assert str(tmp_path) not in md and "imagefolder:../../data/img" in md, md
    assert "seed 0 (n=1)" in md.splitlines()[2]
