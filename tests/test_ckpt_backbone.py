"""`ckpt:<path>` backbones (docs/contracts.md 3f): a fine-tuned network's weights on its base
backbone, keyed by the file's sha256; `fedheads finetune` exports each seed's fine-tuned backbone
so that `embedcache extract` caches its features; bad files give one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import live_doubles  # noqa: F401  (registers tiny-staged)
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from store_doubles import make_imagefolder, make_manifest
from test_live_finetune import _opts as live_opts
from test_live_finetune import setup  # noqa: F401  (the fine-tuning tests' images, manifest and store)

from embedcache.backbones import create_backbone, list_backbones, register_backbone
from embedcache.backbones.base import TorchBackbone, state_dict_sha256
from embedcache.backbones.cifar_resnet import PREPROCESS, CifarResNet
from embedcache.backbones.ckpt import FORMAT, save_backbone_checkpoint
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import save_manifest
from embedcache.store.reader import load_split
from fedheads.finetuning.model import LiveNet, Trainable
from fedheads.finetuning.runner import FinetuneOptions, finetune_run


def _resnet8(weights_dir=None, device: str = "cpu") -> TorchBackbone:
    """A real StagedNet layout (the CIFAR ResNet's stem/layer1-3/pool) without a weights file."""
    torch.manual_seed(3)
    net = CifarResNet(8).eval()
    return TorchBackbone("ckpt-test-resnet8", net, weights_sha256=state_dict_sha256(net.state_dict()),
                         preprocess=PREPROCESS, device=device)


register_backbone("ckpt-test-resnet8", _resnet8, description="test double: random CIFAR ResNet-8",
                  cut_points=("stem", "layer1", "layer2", "layer3"))


def _perturbed(name: str) -> torch.nn.Module:
    staged = create_backbone(name).trainable()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in staged.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return staged.eval()


def _batch(shape, n: int = 3) -> torch.Tensor:
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("base", ["tiny-staged", "ckpt-test-resnet8"])
def test_checkpoint_is_the_base_with_new_weights(tmp_path, base):
    staged = _perturbed(base)
    path = tmp_path / "ft.pt"
    sha = save_backbone_checkpoint(path, base, staged, note="test")
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    bb, orig = create_backbone(f"ckpt:{path}"), create_backbone(base)
    assert bb.name == f"ckpt:{path}" and bb.weights_sha256 == sha
    assert bb.preprocess == orig.preprocess and bb.feature_dim == orig.feature_dim
    x = _batch(orig.preprocess["input_size"])
    with torch.no_grad():
        want = staged(x)
    assert torch.equal(bb.embed(x), want) and not torch.allclose(orig.embed(x), want)
    net = bb.trainable()  # a fresh trainable copy, named like the backbone
    assert net.name == bb.name and all(p.requires_grad for p in net.parameters()) and not net.training
    with torch.no_grad():
        next(net.parameters()).add_(1.0)
    assert torch.equal(bb.embed(x), want), "training the copy changed the backbone"
    cut = net.cut_points()[0]
    cb = create_backbone(f"ckpt:{path}@{cut}")
    with torch.no_grad():
        assert torch.equal(cb.embed(x), staged(x, stop=cut).flatten(1))
    assert cb.weights_sha256 == sha and cb.preprocess["cut"] == cut
    img = Image.new("RGB", (12, 9), (200, 10, 10))
    assert torch.equal(bb.transform(img), orig.transform(img))


def test_same_weights_same_bytes(tmp_path):
    staged = _perturbed("tiny-staged")
    a = save_backbone_checkpoint(tmp_path / "a.pt", "tiny-staged", staged, note="n")
    b = save_backbone_checkpoint(tmp_path / "b.pt", "tiny-staged", staged, note="n")
    assert a == b and (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = {k: v.clone() for k, v in _perturbed("tiny-staged").state_dict().items()}
    out = {}

    def put(name: str, obj, match: str) -> None:
        p = tmp_path / f"{name}.pt"
        torch.save(obj, p)
        out[name] = (p, match)

    out["missing"] = (tmp_path / "nope.pt", "not found")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    out["garbage"] = (tmp_path / "garbage.pt", "not a readable torch checkpoint")
    put("other_format", {"format": "fedheads-finetune-ckpt/1", "params": good}, "not an embedcache-ckpt-backbone/1")
    put("unknown_base", {"format": FORMAT, "base": "no-such-backbone", "state_dict": good}, "no-such-backbone")
    put("cut_base", {"format": FORMAT, "base": "tiny-staged@stem", "state_dict": good}, "no @cut")
    put("nested", {"format": FORMAT, "base": "ckpt:x.pt", "state_dict": good}, "not ckpt:")
    put("missing_key", {"format": FORMAT, "base": "tiny-staged",
                        "state_dict": {k: v for k, v in good.items() if k != "block.0.weight"}}, "missing keys")
    put("extra_key", {"format": FORMAT, "base": "tiny-staged", "state_dict": {**good, "head.weight": torch.ones(2)}},
        "unexpected keys")
    put("bad_shape", {"format": FORMAT, "base": "tiny-staged", "state_dict": {**good, "stem.0.weight": torch.ones(1)}},
        "wrong shape")
    put("no_tensors", {"format": FORMAT, "base": "tiny-staged", "state_dict": {"a": 1}}, "tensors")
    return out


def test_bad_checkpoints_are_one_line_naming_the_file(tmp_path):
    for what, (path, match) in _bad_files(tmp_path).items():
        with pytest.raises(UserError, match=match) as err:
            create_backbone(f"ckpt:{path}")
        assert "\n" not in str(err.value) and str(path) in str(err.value), what
    with pytest.raises(UserError, match="name a checkpoint file"):
        create_backbone("ckpt:")
    with pytest.raises(UserError, match="no @cut"):
        save_backbone_checkpoint(tmp_path / "x.pt", "tiny-staged@stem", _perturbed("tiny-staged"))
    assert not (tmp_path / "x.pt").exists()


def test_listed_and_refused_by_the_cli(tmp_path):
    from embedcache.cli import main

    assert "ckpt:<path>" in {r.name for r in list_backbones()}
    root = make_imagefolder(tmp_path / "img", domains=("a",), per_class=2, size=8)
    save_manifest(make_manifest(root, test_every=2), tmp_path / "m.json")
    res = CliRunner().invoke(main, ["extract", "--manifest", str(tmp_path / "m.json"), "--store",
                                    str(tmp_path / "s.zarr"), "--backbones", f"ckpt:{tmp_path / 'gone.pt'}"])
    errors = [line for line in res.output.splitlines() if not line.startswith("note:")]
    assert res.exit_code == 2 and errors == [f"error: ckpt:{tmp_path / 'gone.pt'}: checkpoint file not found"]
    assert not (tmp_path / "s.zarr").exists()


# ------------------------------------------------------------------ export by fedheads finetune
def _opts(**kw) -> FinetuneOptions:
    return live_opts(**{"rounds": 1, "heads": ("random",), **kw})


def _finetuned(out: Path, trainable: str, num_classes: int) -> torch.nn.Module:
    """The staged net of the final global model, rebuilt from the round checkpoint."""
    ck = torch.load(out / "state" / "seed0.ckpt.pt", weights_only=True)
    staged = create_backbone("tiny-staged").trainable()
    LiveNet(staged, Trainable.parse(trainable), num_classes).load_trained_state({**ck["params"], **ck["buffers"]})
    return staged.eval()


@pytest.mark.parametrize("trainable", ["all", "after:stem"])
def test_finetune_exports_a_backbone_that_extract_caches(setup, tmp_path, trainable):  # noqa: F811 (fixture imported from test_live_finetune)
    root, m = setup
    out = tmp_path / "run"
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", out, _opts(trainable=trainable))
    path = out / "state" / "seed0.backbone.pt"
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == FORMAT and blob["base"] == "tiny-staged" and "trainable " + trainable in blob["note"]
    want = _finetuned(out, trainable, len(m.classes))
    pre = create_backbone("tiny-staged").trainable()
    assert set(blob["state_dict"]) == set(pre.state_dict())  # the backbone only: no head
    for k, v in blob["state_dict"].items():
        torch.testing.assert_close(v, want.state_dict()[k], rtol=0, atol=0)
    changed = {k.split(".")[0] for k, v in blob["state_dict"].items()
               if v.is_floating_point() and not torch.equal(v, pre.state_dict()[k])}
    assert changed == ({"stem", "block"} if trainable == "all" else {"block"})  # frozen prefix: pre-trained

    name = f"ckpt:{path}"
    extract(m, ExtractConfig(backbones=(name,), store=str(tmp_path / "ft.zarr"), batch_size=64, progress=False))
    bb = create_backbone(name)
    from embedcache.sources import open_source

    src = open_source(m.source)
    for split in ("train", "test"):
        got = load_split(str(tmp_path / "ft.zarr"), [name], split)
        for c in m.clients:
            samples = m.samples(c.name, split)
            x = torch.stack([bb.transform(src.load(s.locator)) for s in samples])
            with torch.no_grad():
                ref = want(x).numpy()
            assert list(got[c.name].sample_ids) == [s.id for s in samples]
            np.testing.assert_allclose(got[c.name].features, ref, rtol=1e-6, atol=1e-6)


def test_no_export_when_only_the_head_trains(setup, tmp_path):  # noqa: F811 (fixture imported from test_live_finetune)
    root, _ = setup
    out = tmp_path / "head"
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", out,
                 _opts(trainable="head", heads=("fedncm",)))
    assert (out / "state" / "seed0.ckpt.pt").is_file() and not (out / "state" / "seed0.backbone.pt").exists()


def test_real_resnet20_checkpoint_round_trip(cifar_weights, tmp_path):
    staged = create_backbone("resnet20-cifar10", weights_dir=cifar_weights.parent).trainable()
    path = tmp_path / "r20.pt"
    save_backbone_checkpoint(path, "resnet20-cifar10", staged)
    bb = create_backbone(f"ckpt:{path}@layer2", weights_dir=cifar_weights.parent)
    x = _batch((3, 32, 32), 2)
    ref = create_backbone("resnet20-cifar10@layer2", weights_dir=cifar_weights.parent)
    assert torch.equal(bb.embed(x), ref.embed(x)) and bb.weights_sha256 != ref.weights_sha256


def test_text_encoder_checkpoint_is_a_text_backbone(tmp_path):
    """FedDRA's trained text encoder as `ckpt:`: the base's tokenizer, the file's weights, token
    states as B@CUT, and a re-export names the registry base (not the ckpt: file)."""
    import text_plugin  # noqa: F401  (registers tinytext)

    from embedcache.backbones.ckpt import read_backbone_checkpoint

    base = create_backbone("tinytext")
    net = base.trainable()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    path = tmp_path / "text-seed0.pt"
    save_backbone_checkpoint(path, "tinytext", net, "test")
    bb = create_backbone(f"ckpt:{path}")
    assert bb.modality == "text" and bb.registry_base == "tinytext" and bb.weights_sha256 == read_backbone_checkpoint(path)[1]
    ids, mask = bb.tokenize(["a red square", "the blue one"])
    assert torch.equal(bb.tokenize(["a red square", "the blue one"])[0], base.tokenize(["a red square", "the blue one"])[0])
    with torch.no_grad():
        want = net(ids, mask=mask)
    torch.testing.assert_close(bb.embed((ids, mask)), want, rtol=0, atol=0)
    assert not torch.allclose(bb.embed((ids, mask)), base.embed((ids, mask)))
    cut = create_backbone(f"ckpt:{path}@layer.1")
    assert cut.cut == "layer.1" and cut.registry_base == "tinytext" and cut.weights_sha256 == bb.weights_sha256
    torch.testing.assert_close(cut.embed((ids, mask)).reshape(2, cut.max_length, -1)[:, : ids.shape[1]],
                               bb.token_states(ids, mask), rtol=0, atol=0)
    again = bb.trainable()
    for (k, a), b in zip(again.state_dict().items(), net.state_dict().values()):
        assert torch.equal(a, b), k
