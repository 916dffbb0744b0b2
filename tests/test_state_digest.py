"""Run states are sealed (fedheads.run.checkpoint): a bit flipped in a tensor's bytes of a final state,
a per-round checkpoint (train, finetune, FedDRA), a Flower server state or a `ckpt:` backbone
file is one line naming the file, and nothing is used; an intact state loads bit-identically; a
pickle or any non-torch file given as a state is one line too; a state written before the seal
is used with a note."""

from __future__ import annotations

import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_fedheads_cli import _write_store

from embedcache.errors import UserError
from fedheads.cli import main
from fedheads.run import checkpoint


def flip_tensor_bit(path: Path) -> None:
    """Flip one bit in the middle of the largest tensor storage of torch file `path`, in place
    (the zip's own CRCs are left as they were: torch does not check them on load)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename and i.file_size), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(raw)


def _one_line_error(args: list[str], *needles: str) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert "internal error" not in lines[0], r.output
    for n in needles:
        assert n in lines[0], r.output
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("sd"))


@pytest.fixture(scope="module")
def run(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "fedpcl"
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                                  "--rounds", "2", "--seeds", "0", "--device", "cpu", "--quiet", "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def _predict(run: Path, store: Path, out: Path) -> list[str]:
    return ["predict", "--run", str(run), "--store", str(store), "--quiet", "--out", str(out)]


def test_predict_refuses_a_corrupt_final_state(run, store, tmp_path):
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    flip_tensor_bit(bad / "state" / "seed0.pt")
    _one_line_error(_predict(bad, store, tmp_path / "p.csv"), "seed0.pt", "corrupt", "train the run again")
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize("content", [pickle.dumps({"format": "fedheads-state/1", "client": [1.5]}),
                                     pickle.dumps(__import__("fractions").Fraction(1, 3)),
                                     b"not a state at all\n"], ids=["pickle", "pickled-object", "text"])
def test_predict_refuses_a_state_that_is_not_a_torch_file(run, store, tmp_path, content):
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    (bad / "state" / "seed0.pt").write_bytes(content)
    _one_line_error(_predict(bad, store, tmp_path / "p.csv"), "seed0.pt", "not a readable fedheads-state/1 file")
    assert not (tmp_path / "p.csv").exists()


def test_intact_state_loads_bit_identically_and_predicts(run, store, tmp_path):
    from fedheads.run.saved import open_run

    saved = torch.load(run / "state" / "seed0.pt", map_location="cpu", weights_only=True)
    assert saved[checkpoint.DIGEST] == checkpoint.state_digest(saved)
    t = open_run(run)
    from fedheads.core.tree import tree_leaves

    got = [x.cpu() for x in tree_leaves(t.client_state)] + [x.cpu() for x in tree_leaves(t.server_state)]
    want = saved["client"] + saved["server"]
    assert len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    r = CliRunner().invoke(main, _predict(run, store, tmp_path / "p.csv"), catch_exceptions=False)
    assert r.exit_code == 0, r.output


def test_state_without_digest_is_used_with_a_note(run, store, tmp_path, capsys):
    old = tmp_path / "run"
    shutil.copytree(run, old)
    blob = torch.load(old / "state" / "seed0.pt", weights_only=True)
    del blob[checkpoint.DIGEST]
    torch.save(blob, old / "state" / "seed0.pt")  # as the code before the seal wrote it
    got = checkpoint.load_sealed(old / "state" / "seed0.pt", "fedheads-state/1", "")
    assert "written before state files carried a digest" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(got["client"], blob["client"]))
    r = CliRunner().invoke(main, _predict(old, store, tmp_path / "p.csv"), catch_exceptions=False)
    assert r.exit_code == 0, r.output


def _train(store: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl", "--rounds", "3",
            "--seeds", "0", "--device", "cpu", "--quiet", "--out", str(out), *extra]


def test_resume_refuses_a_corrupt_checkpoint(store, tmp_path, monkeypatch):
    from fedheads.run import checkpoint as resume

    class Stop(Exception):
        pass

    orig = resume.HeadCheckpoint.save

    def save(self, state):
        orig(self, state)
        if state.round == 2:
            raise Stop

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(resume.HeadCheckpoint, "save", save)
        r = CliRunner().invoke(main, _train(store, out))
        assert r.exit_code == 1 and "Stop" in r.output, r.output
    ckpt = out / "state" / "seed0.ckpt.pt"
    flip_tensor_bit(ckpt)
    before = ckpt.read_bytes()
    _one_line_error(_train(store, out, "--resume"), "seed0.ckpt.pt", "corrupt", "--overwrite", "delete it")
    assert ckpt.read_bytes() == before and not (out / "results.json").exists()
    assert not (out / "state" / "seed0.pt").exists()
    r = CliRunner().invoke(main, _train(store, out, "--overwrite"), catch_exceptions=False)  # what the line says
    assert r.exit_code == 0, r.output


def test_resume_of_a_finished_run_refuses_a_corrupt_checkpoint(run, store, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    flip_tensor_bit(out / "state" / "seed0.ckpt.pt")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "results.json"}
    args = ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl", "--rounds", "2",
            "--seeds", "0", "--device", "cpu", "--quiet", "--out", str(out), "--resume"]
    _one_line_error(args, "seed0.ckpt.pt", "corrupt")
    # nothing rewritten from it (results.json goes at the start of any resume: complete again when rewritten)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "results.json"} == before
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("fmt", ["fedheads-train-ckpt/1", "fedheads-finetune-ckpt/1", "fedheads-feddra-ckpt/1"])
def test_every_checkpoint_format_is_sealed(tmp_path, fmt):
    path, cfg = tmp_path / "seed0.ckpt.pt", {"seed": 0}
    params = {"w": torch.randn(7, 5), "b": torch.arange(5, dtype=torch.int64), "h": torch.randn(3, dtype=torch.bfloat16)}
    checkpoint.save_checkpoint(path, fmt, cfg, 2, {"params": params, "opt": [torch.ones(2), True, None]},
                               [{"round": 1, "accuracy": torch.tensor([0.5, 0.25])}])
    got = checkpoint.load_checkpoint(path, fmt, cfg)
    assert got["round"] == 2 and got["opt"][1:] == [True, None]
    assert all(torch.equal(got["params"][k], v) and got["params"][k].dtype == v.dtype for k, v in params.items())
    flip_tensor_bit(path)
    with pytest.raises(UserError, match=r"seed0.ckpt.pt: corrupt .*--overwrite, or delete it and --resume"):
        checkpoint.load_checkpoint(path, fmt, cfg)


def test_the_digest_covers_plain_values_too():
    blob = {"format": "x", "round": 3, "history": [{"seconds": 0.5}], "t": [torch.zeros(2)]}
    d = checkpoint.state_digest(blob)
    assert checkpoint.state_digest({**blob, "round": 4}) != d
    assert checkpoint.state_digest({**blob, "history": [{"seconds": 0.25}]}) != d
    assert checkpoint.state_digest({**blob, "t": [torch.zeros(2, dtype=torch.float64)]}) != d
    assert checkpoint.state_digest({**blob, "t": [torch.zeros(1, 2)]}) != d
    assert checkpoint.state_digest({**blob, checkpoint.DIGEST: "anything"}) == d


def test_flower_server_state_is_sealed(tmp_path):
    from fedheads.flower.results import SERVER_STATE_FORMAT, server_state_blob
    from fedheads.run.rundir import RunDir

    path = RunDir(tmp_path).save_state("seed0.server.pt", server_state_blob({"protos": torch.randn(4, 6),
                                                                            "count": torch.tensor(3)}))
    got = checkpoint.load_sealed(path, SERVER_STATE_FORMAT, "")
    assert [tuple(t.shape) for t in got["server"]] in ([(), (4, 6)], [(4, 6), ()])
    flip_tensor_bit(path)
    with pytest.raises(UserError, match="seed0.server.pt: corrupt"):
        checkpoint.load_sealed(path, SERVER_STATE_FORMAT, "")


def test_ckpt_backbone_file_is_sealed(tmp_path):
    from embedcache.backbones.ckpt import read_backbone_checkpoint, save_backbone_checkpoint

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    path = tmp_path / "seed0.backbone.pt"
    save_backbone_checkpoint(path, "digitnet-builtin", net)
    blob, _ = read_backbone_checkpoint(path)
    assert all(torch.equal(blob["state_dict"][k], v) for k, v in net.state_dict().items())
    old = tmp_path / "old.pt"  # a file by contract 3f without a digest (older, or written by hand)
    torch.save({k: v for k, v in blob.items() if k != "digest"}, old)
    read_backbone_checkpoint(old)
    flip_tensor_bit(path)
    with pytest.raises(UserError, match=r"ckpt:.*seed0.backbone.pt: corrupt"):
        read_backbone_checkpoint(path)


def test_finetune_resume_refuses_a_corrupt_checkpoint(tmp_path_factory, tmp_path):
    import live_doubles

    from fedheads.finetuning.algorithm import FTConfig
    from fedheads.finetuning.runner import FinetuneOptions, finetune_run

    root = tmp_path_factory.mktemp("live")
    live_doubles.make_staged_store(root)
    opts = {"ft": FTConfig(lr=0.05, batch_size=4), "num_workers": 0, "progress": False, "device": "cpu"}
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    finetune_run(*args, tmp_path / "ft", FinetuneOptions(rounds=1, **opts))
    ckpt = tmp_path / "ft" / "state" / "seed0.ckpt.pt"
    flip_tensor_bit(ckpt)
    before = {p: p.read_bytes() for p in (ckpt, ckpt.with_name("seed0.backbone.pt"))}
    with pytest.raises(UserError, match=r"seed0.ckpt.pt: corrupt"):
        finetune_run(*args, tmp_path / "ft", FinetuneOptions(rounds=2, resume=True, **opts))
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "ft" / "results.json").exists()
