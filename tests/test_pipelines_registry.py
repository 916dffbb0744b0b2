"""The experiment registry: consistency, the transcription of the published numbers (cross-checked
where the papers print the same run in two tables), requirements ("not available yet"), the CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from store_doubles import assert_one_line

from embedcache.errors import UserError
from pipelines import plan, registry
from pipelines.cli import main
from pipelines.spec import parse_cell


def _pub(name: str, method: str, metric: str = "acc", **coords) -> tuple[float | None, float | None]:
    exp = registry.get(name)
    hits = [p for p in exp.published if p.method == method and p.metric == metric and dict(p.coords) == coords]
    assert len(hits) == 1, (name, method, metric, coords, len(hits))
    return hits[0].value, hits[0].std


def test_every_experiment_is_consistent_and_named_once():
    exps = registry.experiments()
    assert len({e.name for e in exps}) == len(exps) >= 22
    for e in exps:
        e.check()
        assert e.paper in registry.PAPERS
        for p in e.published:  # a value not transcribed always says why
            assert p.value is not None or p.note, (e.name, p)
    needed = {"fedpcl-table2", "fedpcl-table3", "fedpcl-table11", "fedpcl-table4", "fedpcl-table5", "fedpcl-table6",
              "fedpcl-figure2a", "fedpcl-figure2b", "fedpcl-table12-13", "fedpcl-table14", "fedpcl-table15",
              "fedncm-table2", "fedncm-figure1", "fedncm-table3", "fedncm-table5", "fedncm-table6", "fedncm-figure5",
              "feddra-table2", "feddra-table3", "feddra-table7", "feddra-table8", "feddra-table9"}
    assert needed <= {e.name for e in exps}


@pytest.mark.parametrize("text,value", [
    ("82.75(0.40)", (82.75, 0.40)), ("87.2 ± 0.2", (87.2, 0.2)), ("34.2", (34.2, None)),
    ("133,632", (133632.0, None)), ("4.5e8", (4.5e8, None)), ("4.10e-3", (4.10e-3, None)), ("?", (None, None))])
def test_parse_cell(text, value):
    assert parse_cell(text) == value


def test_parse_cell_refuses_garbage():
    with pytest.raises(ValueError):
        parse_cell("83.283.7")


def test_fedpcl_values_printed_twice_agree():
    """FedPCL prints several runs in two tables; the transcriptions must agree."""
    for method in ("FedAvg", "pFedMe", "Per-FedAvg", "FedRep", "FedProto", "Solo", "Ours"):
        assert _pub("fedpcl-table3", method, dataset="Office-10") == \
            _pub("fedpcl-table11", method, feature="Non-IID", BB="m", dataset="Office-10")
        assert _pub("fedpcl-table3", method, dataset="DomainNet") == \
            _pub("fedpcl-table11", method, feature="IID", BB="m", dataset="DomainNet")
    fls_m = _pub("fedpcl-table11", "Ours", feature="Non-IID", BB="m", dataset="Digit-5")
    assert fls_m == (45.22, 3.65)
    assert _pub("fedpcl-table5", "Ours", setting="feature & label shift") == fls_m
    assert _pub("fedpcl-table14", "Ours", backbones=3) == fls_m
    assert _pub("fedpcl-table14", "Ours", backbones=1) == \
        _pub("fedpcl-table11", "Ours", feature="Non-IID", BB="s", dataset="Digit-5")
    assert _pub("fedpcl-table5", "Cross Entropy", setting="feature & label shift") == \
        _pub("fedpcl-table11", "FedAvg", feature="Non-IID", BB="m", dataset="Digit-5")
    assert _pub("fedpcl-table6", "Global and local", setting="Feature shift non-IID") == \
        _pub("fedpcl-table2", "Ours", BB="m")
    assert _pub("fedpcl-table6", "Global and local", setting="Label shift non-IID") == \
        _pub("fedpcl-table11", "Ours", feature="IID", BB="m", dataset="Digit-5")
    assert _pub("fedpcl-table15", "FedPCL", **{"noise on": "/", "noise": "/"}) == \
        _pub("fedpcl-table11", "Ours", feature="IID", BB="m", dataset="Office-10")
    assert _pub("fedpcl-table2", "FedAvg", "comm_params", BB="m") == (395776.0, None)
    assert _pub("fedpcl-table2", "FedProto", "domain:USPS", BB="m") == (91.74, 0.0)


def test_fedncm_and_feddra_values_printed_twice_agree():
    for method, alg_value in (("FedNCM", (64.8, 0.1)), ("FedNCM+FT", (87.2, 0.2)), ("FT", (85.4, 0.4))):
        assert _pub("fedncm-table3", method, dataset="CIFAR-10", algorithm="FedAvg") == alg_value
        assert _pub("fedncm-table2", method, dataset="CIFAR-10") == alg_value
    assert _pub("fedncm-table5", "LP", dataset="EuroSAT-Sub") == _pub("fedncm-table2", "LP", dataset="EuroSAT-Sub")
    assert _pub("fedncm-table6", "FedNCM", dataset="Flowers-102") == _pub("fedncm-table2", "FedNCM+FT",
                                                                          dataset="Flowers-102")
    assert _pub("fedncm-table2", "FedNCM", "compute_F", dataset="CUB") == (None, None)  # garbled: not guessed
    assert _pub("fedncm-table3", "FedNCM", dataset="Flowers-102", algorithm="FedAdam") == (None, None)
    full = [_pub("feddra-table2", "FedDRA (Ours)", m, VLP="ConVIRT")[0] for m in ("rsna_cls_1", "covid_cls_10", "r1")]
    assert full == [83.2, 90.3, 30.2]
    assert _pub("feddra-table7", "FedDRA (Ours)", "r1", clients=5) == _pub("feddra-table8", "FedDRA (Ours)", "r1",
                                                                           rho=0.1)
    assert _pub("feddra-table9", "FedDRA (Ours)", "r5", mu=5.0) == _pub("feddra-table3", "FedDRA (Ours)", "r5",
                                                                        VLP="ConVIRT")


def test_requirements_say_what_is_missing():
    assert plan.missing_requirement(("field:fedpcl.noise",)) == ""
    assert plan.missing_requirement(("field:fedpcl.prototypes",)) == "not available yet: needs a fedpcl option 'prototypes'"
    assert plan.missing_requirement(("missing:noised images",)) == "not available yet: needs noised images"


def test_select_names_globs_and_all():
    assert [e.name for e in registry.select(["fedpcl-table1*"])] == \
        ["fedpcl-table11", "fedpcl-table12-13", "fedpcl-table14", "fedpcl-table15"]
    assert len(registry.select(["all"])) == len(registry.experiments())
    with pytest.raises(UserError, match="matches nothing"):
        registry.select(["nope-*"])


def test_list_json_gives_every_scale():
    res = CliRunner().invoke(main, ["list", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    t2 = rows["fedpcl-table2"]["scales"]
    # 2 backbone settings x 7 methods: 1 seed at smoke, 3 at ci and paper (builtin:digits is always there)
    assert (t2["smoke"]["cells"], t2["ci"]["cells"], t2["paper"]["cells"]) == (14, 42, 42)


@pytest.mark.parametrize("args,needle", [
    (["run", "fedpcl-tabel2"], "experiment 'fedpcl-tabel2': unknown"),
    (["run", "fedpcl-table2", "--scheduler", "local:0"], "--scheduler 'local:0'"),
    (["run", "fedpcl-table2", "--source", "mnist=imagefolder:x"], "--source 'mnist': unknown data set"),
    (["run", "fedpcl-table2", "--backbone", "resnet20-cifar10"], "expected NAME=OTHER"),
])
def test_bad_input_is_one_line(args, needle):
    assert_one_line(CliRunner().invoke(main, args), 2, needle)
