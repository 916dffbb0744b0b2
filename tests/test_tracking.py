"""`fedheads train/compare --tensorboard`: per-round scalars per seed, read back from the event
files; without the extra, one line saying what to install; --overwrite removes them."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from fedheads.cli import main


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every event file in `folder` (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for f in sorted(folder.glob("events.out.tfevents.*")):
        raw, i = f.read_bytes(), 0
        while i < len(raw):
            (n,) = struct.unpack("<Q", raw[i:i + 8])
            ev = Event.FromString(raw[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("tb"))


def _train(store: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedavg",
                                     "--rounds", "3", "--seeds", "0,1", "--device", "cpu", "--quiet", "--out",
                                     str(out), *extra])


def test_event_files_hold_the_per_round_curve_of_each_seed(store, tmp_path):
    pytest.importorskip("tensorboardX", reason="the [tensorboard] extra is not installed")
    res = _train(store, tmp_path / "r", "--tensorboard", "--eval-every", "2")
    assert res.exit_code == 0, res.output
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    rows = [r for r in (tmp_path / "r" / "metrics.csv").read_text().splitlines()[1:] if ",main," in r]
    for seed in (0, 1):
        tb = _scalars(tmp_path / "r" / "tensorboard" / f"seed{seed}")
        assert set(tb["accuracy/mean"]) == {2, 3}  # evaluated rounds only
        for rnd in (2, 3):
            accs = [float(r.split(",")[4]) for r in rows if r.startswith(f"{rnd},{seed},")]
            assert tb["accuracy/mean"][rnd] == pytest.approx(sum(accs) / len(accs), rel=1e-6)
            assert tb["accuracy/worst"][rnd] == pytest.approx(min(accs), rel=1e-6)
        assert set(tb["communication/upload_bytes"]) == {1, 2, 3}
        total = sum(tb["communication/upload_bytes"].values()) + sum(tb["communication/download_bytes"].values())
        assert tb["communication/total_bytes"][3] == pytest.approx(total)
    comm = results["communication"]
    assert total == pytest.approx(comm["upload_bytes_total"] + comm["download_bytes_total"])  # seed 1's, same as 0's
    assert _train(store, tmp_path / "r", "--overwrite").exit_code == 0
    assert not (tmp_path / "r" / "tensorboard").exists()


def test_without_the_extra_it_is_one_line_saying_what_to_install(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    assert_one_line(_train(store, tmp_path / "r", "--tensorboard"), 2, "--tensorboard:", "pip install")
    assert not (tmp_path / "r").exists()
