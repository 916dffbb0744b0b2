"""The path data_manifests/README.md documents for the papers' real data sets, end to end on tiny
fake copies of each layout: `--source KEY=imagefolder:PATH` turns the stand-in into the paper's
data with nothing else changed, folder names are matched to the paper's domains, and a copy
holding classes the paper does not use is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pipelines_doubles as pd
import pytest
from PIL import Image
from scipy.io import loadmat

from embedcache.errors import UserError
from embedcache.manifest import load_manifest
from pipelines import datasets, plan, registry
from pipelines.prepare import prepare

DIGITS = tuple(str(i) for i in range(10))


def _svhn_as_readme_says(mat: Path, root: Path) -> None:
    """The README's snippet: SVHN's .mat arrays written out as PNGs once (label 10 means digit 0)."""
    d = loadmat(str(mat))
    X, y = d["X"].transpose(3, 0, 1, 2), d["y"].ravel() % 10
    for i, (img, lab) in enumerate(zip(X, y)):
        os.makedirs(root / "svhn" / str(lab), exist_ok=True)
        Image.fromarray(img).save(root / "svhn" / str(lab) / f"{i:06d}.png")


def _manifest(exp: str, coords: dict, source: str, tmp_path: Path):
    ctx = plan.RunContext(scale="smoke", sources=tuple(datasets.parse_sources([source]).items()))
    arm = next(a for a in plan.arms(registry.get(exp), ctx) if dict(a.point.coords) == coords)
    assert arm.data is not None and arm.data.original, arm.unavailable
    got = prepare(arm.data, [], tmp_path / "cache", progress=False)  # the partition only
    return arm, load_manifest(got.manifest_path)


def test_digit5_layout_with_svhn_from_its_mat_file(tmp_path):
    root = pd.make_folder(tmp_path / "digit5", ("mnist", "usps", "synth", "mnistm"), DIGITS, per_class=12)
    _svhn_as_readme_says(pd.make_svhn_mat(tmp_path / "svhn_train_32x32.mat", n=120), root)
    arm, m = _manifest("fedpcl-table2", {"BB": "s"}, f"digit5=imagefolder:{root}", tmp_path)
    assert dict(arm.data.domain_map) == {"MNIST": "mnist", "SVHN": "svhn", "USPS": "usps", "Synth": "synth",
                                         "MNIST-M": "mnistm"}  # the real copy has the SVHN the stand-in lacks
    assert sorted(c.domain for c in m.clients) == ["mnist", "mnistm", "svhn", "synth", "usps"]
    assert all(len(c.train) == 10 * 10 for c in m.clients)  # Table 8: 10 training images per class


def test_office10_layout_as_distributed(tmp_path):
    root = pd.make_folder(tmp_path / "office_caltech10", ("amazon", "caltech10", "dslr", "webcam"),
                          ("back_pack", "bike", "calculator"), per_class=12)
    arm, m = _manifest("fedpcl-table3", {"dataset": "Office-10"}, f"office10=imagefolder:{root}", tmp_path)
    assert dict(arm.data.domain_map) == {"Amazon": "amazon", "Caltech": "caltech10", "DSLR": "dslr",
                                         "WebCam": "webcam"}
    assert sorted(c.domain for c in m.clients) == ["amazon", "caltech10", "dslr", "webcam"]  # 4 clients, one each


def test_domainnet_layout_with_fedpcl_classes_only(tmp_path):
    doms = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
    root = pd.make_folder(tmp_path / "domainnet", doms, datasets.DOMAINNET_CLASSES, per_class=6)
    arm, m = _manifest("fedpcl-table3", {"dataset": "DomainNet"}, f"domainnet=imagefolder:{root}", tmp_path)
    assert dict(arm.data.domain_map) == {"Real": "real"}  # Table 9: label shift within Real
    assert {c.domain for c in m.clients} == {"real"} and len(m.clients) == 5
    assert m.recipe["train_fraction"] == 0.5  # Table 9's 500 training samples, capped at half of the 60 here


def test_a_copy_with_other_classes_is_refused_in_one_line(tmp_path):
    doms = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
    root = pd.make_folder(tmp_path / "domainnet", doms, (*datasets.DOMAINNET_CLASSES, "aircraft_carrier"), per_class=2)
    with pytest.raises(UserError, match=r"1 classes the paper does not use \(e.g. aircraft_carrier\)") as exc:
        _manifest("fedpcl-table3", {"dataset": "DomainNet"}, f"domainnet=imagefolder:{root}", tmp_path)
    assert "\n" not in str(exc.value)


def test_a_missing_domain_folder_names_what_is_there(tmp_path):
    root = pd.make_folder(tmp_path / "office", ("amazon", "dslr"), ("a", "b"), per_class=2)
    with pytest.raises(UserError, match=r"no folder for domain Caltech .* found amazon, dslr"):
        _manifest("fedpcl-table3", {"dataset": "Office-10"}, f"office10=imagefolder:{root}", tmp_path)
