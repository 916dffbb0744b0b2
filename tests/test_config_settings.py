"""One configuration mechanism: an algorithm's settings are the fields of its declared config
dataclass, documented by their `setting()` metadata (no source file needed); `--set` keys are
checked against those fields and the algorithm is built once per run, never once per key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from fedheads.algorithms import _REGISTRY, create_algorithm
from fedheads.cli import main
from fedheads.run.settings import settings_of, settings_table


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("cs"))


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _train(store: Path, out: Path, *extra: str, algorithm: str = "fedncm") -> list:
    return ["train", "--store", store, "--backbones", "synth", "--algorithm", algorithm, "--rounds", "1",
            "--seeds", "0,1", "--device", "cpu", "--quiet", "--out", out, *extra]


@pytest.fixture
def builds(monkeypatch):
    """{algorithm: how many times its factory ran}, for the registered algorithms."""
    from fedheads.algorithms import list_algorithms

    list_algorithms()  # the registry loads lazily: every built-in registered before the factories are wrapped
    calls: dict[str, int] = {}
    for name, info in list(_REGISTRY.items()):
        def counted(_name=name, _f=info.factory, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _f(**kw)
        monkeypatch.setitem(_REGISTRY, name, dataclasses.replace(info, factory=counted))
    return calls


SOURCE = '''
from dataclasses import dataclass
from fedheads.core.config import setting

@dataclass(frozen=True)
class CellConfig:
    """Defined in a notebook cell: no file holds this source."""

    alpha: float = setting(0.5, "mixing weight of the two heads", source="Some paper Sec. 3, Eq. 2")
    steps: int = setting(3, "inner steps")
'''


def test_docs_come_from_field_metadata_without_a_source_file(monkeypatch):
    scope: dict = {}
    exec(compile(SOURCE, "<notebook cell>", "exec"), scope)
    cls = scope["CellConfig"]
    from fedheads.algorithms import register_algorithm
    from fedheads.algorithms.fedncm import FedNCM

    monkeypatch.setitem(_REGISTRY, "cell", _REGISTRY["fedncm"])  # replaced below; restored after the test
    register_algorithm("cell", lambda **kw: FedNCM(), description="a notebook algorithm", config=cls)
    rows = {r.key: r for r in settings_of("cell")[0]}
    assert rows["alpha"].doc == "mixing weight of the two heads" and rows["alpha"].source == "Some paper Sec. 3, Eq. 2"
    assert rows["steps"].default == 3 and rows["steps"].doc == "inner steps" and rows["steps"].source == ""
    table = settings_table("cell")
    assert "mixing weight of the two heads [Some paper Sec. 3, Eq. 2]" in table and "no file holds" in table


def test_an_inapplicable_key_is_refused_by_name_and_nothing_is_built(store, tmp_path, builds):
    res = _cli(*_train(store, tmp_path / "o", "--set", "lr=0.1"))  # fedncm has no client optimiser
    assert_one_line(res, 2, "--set lr: not a setting of fedncm")
    assert builds == {} and not (tmp_path / "o").exists()
    res = _cli(*_train(store, tmp_path / "o", "--set", "hidden=8", algorithm="lp"))  # mlp's, fixed for lp
    assert_one_line(res, 2, "--set hidden: not a setting of lp")
    assert builds == {}


def test_a_run_builds_its_algorithm_once_with_every_key(store, tmp_path, builds):
    res = _cli(*_train(store, tmp_path / "o", "--set", "init=fedncm", "--set", "server_lr=0.5", "--lr", "0.05",
                       algorithm="lp"))
    assert res.exit_code == 0, res.output
    assert builds == {"lp": 1}  # two seeds, config.json and config.yaml: one build
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["algorithm_kwargs"] == {"init": "fedncm", "server_lr": 0.5, "lr": 0.05}
    assert cfg["algorithm_config"]["optimizer"]["lr"] == 0.05
    kept = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())["set"]
    assert kept["init"] == "fedncm" and kept["lr"] == 0.05 and "hidden" not in kept


def test_compare_applies_a_key_where_it_is_a_field(store, tmp_path, builds):
    res = _cli("compare", "--store", store, "--backbones", "synth", "--algorithms", "fedncm,lp,mlp", "--rounds", "1",
               "--seeds", "0", "--device", "cpu", "--quiet", "--out", tmp_path / "c",
               "--set", "lr=0.05", "--set", "hidden=8")
    assert res.exit_code == 0, res.output
    assert builds == {"fedncm": 1, "lp": 1, "mlp": 1}
    kw = {a: json.loads((tmp_path / "c" / a / "config.json").read_text()) for a in ("fedncm", "lp", "mlp")}
    assert kw["fedncm"]["algorithm_kwargs"] == {} and sorted(kw["fedncm"]["ignored_options"]) == ["hidden", "lr"]
    assert kw["lp"]["algorithm_kwargs"] == {"lr": 0.05} and kw["lp"]["ignored_options"] == ["hidden"]
    assert kw["mlp"]["algorithm_kwargs"] == {"lr": 0.05, "hidden": 8}
    assert kw["mlp"]["algorithm_config"]["hidden"] == [8, 8]


def test_compare_refuses_a_key_no_algorithm_has(store, tmp_path, builds):
    res = _cli("compare", "--store", store, "--backbones", "synth", "--algorithms", "fedncm,lp", "--rounds", "1",
               "--seeds", "0", "--device", "cpu", "--quiet", "--out", tmp_path / "c", "--set", "hidden=8")
    assert_one_line(res, 2, "--set hidden: not a setting of fedncm, lp")
    assert builds == {}


def test_a_wrong_value_is_one_line_naming_the_algorithm(store, tmp_path):
    res = _cli(*_train(store, tmp_path / "o", "--set", "server_opt=nope", algorithm="lp"))
    assert_one_line(res, 2, "server_opt 'nope'")
    with pytest.raises(Exception, match="hidden: not a setting of lp: the linear probe has no hidden layer"):
        create_algorithm("lp", hidden=(4,))



@pytest.mark.parametrize("algorithm,item,needle", [
    ("fed3r", "lam=abc", "--set lam=abc: fed3r's lam takes a number"),  # float
    ("fed3r", "lam=true", "--set lam=true: fed3r's lam takes a number"),
    ("fed3r", "bias=yes", "--set bias=yes: fed3r's bias takes true or false"),  # bool: no truthy text
    ("fed3r", "bias=1", "--set bias=1: fed3r's bias takes true or false"),
    ("fedavg", "batch_size=2.5", "--set batch_size=2.5: fedavg's batch_size takes an integer"),  # int
    ("lp", "server_opt=3", "--set server_opt=3: lp's server_opt takes text"),  # a str choice
    ("lp", "server_opt=nope", "server_opt 'nope': must be one of fedavg"),  # text, not a choice: the config says which
    ("lp", "server_lr=x", "--set server_lr=x: lp's server_lr takes a number or null"),  # float | None
])
def test_a_value_of_the_wrong_type_names_what_the_field_takes(store, tmp_path, builds, algorithm, item, needle):
    res = _cli(*_train(store, tmp_path / "o", "--set", item, algorithm=algorithm))
    assert_one_line(res, 2, needle)
    assert "not supported between" not in res.output and "instances of" not in res.output
    assert builds == ({algorithm: 1} if "nope" in item else {})  # a wrong type is refused before building
    assert not (tmp_path / "o").exists()

# ------------------------------------------------------------------ finetune / feddra: --set, aliases, files

FT = ["finetune", "--manifest", "m.json", "--store", "s.zarr", "--backbone", "resnet20-cifar10", "--out", "o"]
FD = ["feddra", "--manifest", "m.json", "--image-encoder", "resnet20-cifar10", "--text-encoder", "minilm-l6-v2",
      "--out", "o"]


@pytest.fixture
def ran(monkeypatch):
    """The options each finetune / feddra command would run with (nothing trains)."""
    import fedheads.alignment.runner as fd_runner
    import fedheads.finetuning.runner as ft_runner

    seen: list = []
    monkeypatch.setattr(ft_runner, "finetune_run", lambda *a: seen.append(a[-1]) or {"algorithms": {}})
    monkeypatch.setattr(fd_runner, "feddra_run", lambda *a: seen.append(a[-1]) or {"algorithms": {}})
    return seen


def _notes(res) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("note:")]


def test_finetune_takes_its_settings_with_set(ran):
    res = _cli(*FT, "--set", "server=fedadam", "--set", "lr=0.01", "--set", "trainable=after:layer2",
               "--set", "head_rounds=3", "--set", "augment=false", "--set", "server_lr=null")
    assert res.exit_code == 0, res.output
    (opts,) = ran
    assert (opts.ft.server, opts.ft.lr, opts.ft.server_lr) == ("fedadam", 0.01, None)
    assert (opts.trainable, opts.head_rounds, opts.augment, opts.pretrained) == ("after:layer2", 3, False, True)
    assert _notes(res) == []


@pytest.mark.parametrize("args,needle", [
    (FT + ["--server", "fedadam"], "--server: replaced by --set server=VALUE"),
    (FT + ["--no-pretrained"], "--no-pretrained: replaced by --set pretrained=false"),
    (FT + ["--warmup-rounds", "2"], "--warmup-rounds: replaced by --set warmup_rounds=VALUE"),
    (FD + ["--steps-per-stage", "7"], "--steps-per-stage: replaced by --set steps=VALUE"),
    (FD + ["--no-two-stage"], "--no-two-stage: replaced by --set two_stage=false"),
    (FD + ["--rho", "0.3"], "--rho: replaced by --set rho=VALUE"),
])
def test_former_options_are_refused_naming_their_replacement(ran, args, needle):
    """The options that became --set keys are gone: each is one line naming its --set key, exit 2,
    nothing run (no alias is accepted silently)."""
    assert_one_line(_cli(*args), 2, needle, "(the option was removed)")
    assert ran == []


def test_feddra_takes_its_settings_with_set_over_the_preset(ran):
    res = _cli(*FD, "--preset", "quick", "--set", "mu=1", "--set", "rho=0.3", "--set", "steps=7",
               "--set", "two_stage=false")
    assert res.exit_code == 0, res.output
    (opts,) = ran
    assert (opts.fd.mu, opts.fd.dro.rho, opts.fd.steps, opts.fd.two_stage) == (1.0, 0.3, 7, False)
    assert (opts.fd.rounds, opts.fd.batch_size, opts.text_trainable) == (4, 32, "frozen")  # the preset's
    assert _notes(res) == []


@pytest.mark.parametrize("args,needle", [
    (FT + ["--set", "servr=fedadam"], "--set servr: not a setting of `fedheads finetune` (did you mean server?"),
    (FT + ["--set", "pretrained=maybe"], "--set pretrained=maybe: expected bool"),
    (FT + ["--set", "server=nope"], "server 'nope': use one of"),
    (FD + ["--set", "rho=abc"], "--set rho=abc: expected float"),
    (FD + ["--set", "rounds=3"], "--set rounds: not a setting of `fedheads feddra`"),  # it is --rounds
])
def test_a_bad_setting_is_one_line_naming_it(ran, args, needle):
    assert_one_line(_cli(*args), 2, needle)
    assert ran == []


@pytest.mark.parametrize("args", [FT + ["--set", "server=fedprox", "--set", "lr=0.05"],
                                  FD + ["--preset", "quick", "--set", "rho=0.2"]])
def test_the_dump_has_every_setting_and_reads_back_as_yaml_or_json(tmp_path, args):
    from fedheads.alignment.runner import SETTINGS as FD_SETTINGS
    from fedheads.finetuning.runner import SETTINGS as FT_SETTINGS
    from fedheads.run.settings import command_settings

    first = _cli(*args, "--dump-config")
    assert first.exit_code == 0, first.output
    doc = yaml.safe_load(first.stdout)
    parts = FT_SETTINGS if args[0] == "finetune" else FD_SETTINGS
    assert set(doc["set"]) == {s.key for s in command_settings(parts)}  # every setting, with its value
    assert not {"lr", "server", "rho", "steps_per_stage", "no_pretrained"} & set(doc)  # no alias is written
    (tmp_path / "f.json").write_text(json.dumps(doc))
    for f in ("f.json",):
        again = _cli(args[0], "--config", tmp_path / f, "--dump-config")
        assert again.exit_code == 0 and again.stdout == first.stdout, again.output


def test_a_file_written_with_the_former_options_is_one_line(ran, tmp_path):
    (tmp_path / "old.yaml").write_text("command: finetune\nmanifest: m.json\nstore: s.zarr\nbackbone: resnet20-cifar10\n"
                                       "server: fedadam\nout: o\n")
    assert_one_line(_cli("finetune", "--config", tmp_path / "old.yaml"), 2, "old.yaml: server: replaced by --set server=")
    assert ran == []


def test_api_finetune_takes_settings_and_refuses_its_former_keywords(ran, tmp_path):
    import fedheads
    from embedcache.errors import UserError

    fedheads.finetune("m.json", "s.zarr", "resnet20-cifar10", tmp_path / "a", settings={"server": "fedadam", "lr": 0.01})
    assert (ran[0].ft.server, ran[0].ft.lr) == ("fedadam", 0.01)
    with pytest.raises(UserError, match=r"fedheads.finetune: trainable: replaced by settings=\{'trainable': VALUE\}"):
        fedheads.finetune("m.json", "s.zarr", "resnet20-cifar10", tmp_path / "b", trainable="head")
    with pytest.raises(UserError, match="fedheads.finetune: no option servr"):
        fedheads.finetune("m.json", "s.zarr", "resnet20-cifar10", tmp_path / "c", servr="fedadam")
    assert len(ran) == 1


@pytest.mark.parametrize("command,line", [("finetune", ("lr", "0.1", "client SGD learning rate", "[FedNCM App. B]")),
                                          ("feddra", ("rho", "0.1", "radius", "[FedDRA App. A.1]"))])
def test_list_settings_reads_the_docs_from_the_fields(command, line):
    res = _cli(command, "--list-settings")  # no other option needed
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.output.splitlines() if ln.split()[0] == line[0])
    assert all(part in row for part in line), row
