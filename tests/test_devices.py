"""One device parser (embedcache.devices) behind `embedcache extract`, the backbones and
`fedheads train | predict`: a bad --device is one line and exit 2, never a traceback."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from test_fedheads_cli import _write_store

from embedcache.backbones.base import check_device
from embedcache.devices import resolve_device
from embedcache.errors import UserError
from fedheads.run import load as fdata

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("parse", [resolve_device, fdata.resolve_device], ids=["embedcache", "fedheads"])
def test_good_and_bad_spellings(parse):
    assert parse("cpu") == torch.device("cpu") and parse(" CPU ") == torch.device("cpu")
    assert parse(torch.device("cpu")) == torch.device("cpu")
    assert parse("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match=r"^device 'gpu': unknown \(use auto, cpu, cuda or cuda:N\)$"):
        parse("gpu")
    for bad in ("cuda:x", "cuda:", "cuda:-1", "tpu", ""):
        with pytest.raises(UserError, match="unknown"):
            parse(bad)


@pytest.mark.skipif(not NO_CUDA, reason="CUDA present")
def test_cuda_without_cuda():
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(UserError, match=rf"^device '{spec}': CUDA is not available"):
            resolve_device(spec)
    with pytest.raises(UserError, match="^tiny: device 'cuda': CUDA is not available"):
        check_device("cuda", who="tiny")


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_cuda_index_beyond_the_machine():
    n = torch.cuda.device_count()
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(UserError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")


def test_mps_only_where_available():
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        assert resolve_device("mps") == torch.device("mps")
    else:
        with pytest.raises(UserError, match="MPS is not available"):
            resolve_device("mps")


def test_extract_refuses_a_bad_device_before_touching_the_store(tmp_path):
    import store_doubles as d

    from embedcache.cli import main

    root = d.make_imagefolder(tmp_path / "imgs")
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{root}", "--scheme", "feature-shift",
                                    "--train-per-class", "2", "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["extract", "--manifest", str(tmp_path / "m.json"), "--backbones", "tiny",
                                    "--store", str(tmp_path / "s"), "--plugin", "store_doubles", "--device", "gpu"])
    assert res.exit_code == 2 and res.output == "error: device 'gpu': unknown (use auto, cpu, cuda or cuda:N)\n"
    assert not (tmp_path / "s").exists()


def test_fedheads_train_and_predict_with_a_bad_device(tmp_path):
    from fedheads.cli import main

    store = _write_store(tmp_path)
    base = ["--store", str(store), "--backbones", "synth", "--algorithm", "fedncm", "--rounds", "1", "--seeds", "0",
            "--quiet", "--out", str(tmp_path / "run")]
    res = CliRunner().invoke(main, ["train", *base, "--device", "gpu"])
    assert res.exit_code == 2 and res.output == "error: device 'gpu': unknown (use auto, cpu, cuda or cuda:N)\n"
    assert CliRunner().invoke(main, ["train", *base, "--device", "cpu"]).exit_code == 0
    res = CliRunner().invoke(main, ["predict", "--run", str(tmp_path / "run"), "--store", str(store), "--device",
                                    "gpu", "--out", str(tmp_path / "p.csv")])
    assert res.exit_code == 2 and res.output == "error: device 'gpu': unknown (use auto, cpu, cuda or cuda:N)\n"
    assert not (tmp_path / "p.csv").exists()
