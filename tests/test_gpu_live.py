"""The live stages on CUDA, against the CPU (marked gpu, skipped without CUDA; run on a CUDA machine
by benchmarks/gpu_check.sh): fine-tuning (FedNCM+FT, cache-first partial fine-tuning) and FedDRA
through their runners, in float32 (amp off, TF32 off) against the CPU's weights, and under the default
autocast (bf16 where supported) to the end with finite weights and a results contract."""

from __future__ import annotations

import json
from pathlib import Path

import live_doubles
import pytest
import torch
import vl_doubles
from tolerances import assert_mostly_close

from embedcache.manifest import save_manifest
from fedheads.alignment.algorithm import FedDRAConfig
from fedheads.alignment.dro import DROConfig
from fedheads.alignment.runner import FedDRAOptions, feddra_run
from fedheads.finetuning.algorithm import FTConfig
from fedheads.finetuning.runner import FinetuneOptions, finetune_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GPU, CPU = "cuda", "cpu"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_live")
    live_doubles.make_staged_store(root)
    return root


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_feddra")
    m, store = vl_doubles.make_paired(root)
    save_manifest(m, root / "m.json")
    return root, store


@pytest.fixture
def no_text_dropout(monkeypatch):
    """The text double without dropout: stage 2 trains the text encoder in train mode, and its
    dropout masks come from the CPU's or the CUDA generator, which give different streams for one
    seed, so a CPU and a CUDA run would train on different masks (the FedDRA drift an H200 showed:
    31 of 512 elements of psi/inp.weight up to 5.5e-4 apart; on the CPU, runs with and without
    dropout end up to 7.7e-3 apart, and each is bitwise repeatable). Same weights, so the store's
    key still matches."""
    import dataclasses

    from embedcache.backbones import registry

    entry = registry._REGISTRY[vl_doubles.TEXT]

    def factory(wd, dev):
        bb = entry.factory(wd, dev)
        for m in bb._net.modules():
            if isinstance(getattr(m, "p", None), float):  # nn.Dropout and the attention's dropout_p
                m.p = 0.0
        return bb

    monkeypatch.setitem(registry._REGISTRY, vl_doubles.TEXT, dataclasses.replace(entry, factory=factory))


def _ckpt(out: Path) -> dict:
    (path,) = sorted(out.rglob("seed0.ckpt.pt"))
    return torch.load(path, weights_only=True, map_location="cpu")


def _weights(ck: dict) -> dict[str, torch.Tensor]:
    return {**ck["params"], **ck["buffers"]}


def _assert_close_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b) and a
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def _ft(device: str, amp: str = "off", **kw) -> FinetuneOptions:
    base = dict(rounds=2, ft=FTConfig(lr=0.05, batch_size=4, amp=amp), num_workers=0, progress=False, device=device)
    return FinetuneOptions(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, {"trainable": "after:stem", "augment": False}],
                         ids=["fedncm+ft-all", "cache-first-after-stem"])
def test_finetune_on_cuda_matches_cpu(images, tmp_path, kw, float32_math):
    """FedNCM+FT (whole network) and cache-first partial fine-tuning: float32 on CUDA ends at the
    CPU's weights; round 0 (FedNCM on the store) gives the same accuracies."""
    args = (images / "manifest.json", str(images / "s.zarr"), "tiny-staged")
    for name, dev in (("cpu", CPU), ("gpu", GPU)):
        finetune_run(*args, tmp_path / name, _ft(dev, **kw))
    a, b = _ckpt(tmp_path / "cpu"), _ckpt(tmp_path / "gpu")
    assert b["history"][0]["accuracy"] == pytest.approx(a["history"][0]["accuracy"], abs=1e-9)
    _assert_close_weights(_weights(a), _weights(b))
    machine = json.loads((tmp_path / "gpu" / "results.json").read_text())["timing"]["machine"]
    assert machine["device"].startswith(GPU) and (machine["gpu"] or GPU == CPU)


def test_cache_first_equals_live_prefix_on_cuda(images, tmp_path, float32_math):
    args = (images / "manifest.json", str(images / "s.zarr"), "tiny-staged")
    kw = dict(trainable="after:stem", augment=False, heads=("random",))
    finetune_run(*args, tmp_path / "cache", _ft(GPU, **kw))
    finetune_run(*args, tmp_path / "live", _ft(GPU, live_prefix=True, **kw))
    _assert_close_weights(_weights(_ckpt(tmp_path / "cache")), _weights(_ckpt(tmp_path / "live")))


def test_finetune_under_autocast_on_cuda(images, tmp_path):
    """The default amp on CUDA (bf16 where supported, else fp16 with a GradScaler) runs to the end:
    finite float32 weights that keep moving after round 1, and the results contract."""
    args = (images / "manifest.json", str(images / "s.zarr"), "tiny-staged")
    finetune_run(*args, tmp_path / "one", _ft(GPU, amp="auto", rounds=1))
    res = finetune_run(*args, tmp_path / "amp", _ft(GPU, amp="auto", rounds=3))
    ck = _ckpt(tmp_path / "amp")
    w, w1 = _weights(ck), _weights(_ckpt(tmp_path / "one"))
    floats = [k for k in w if w[k].is_floating_point()]
    assert all(w[k].dtype == torch.float32 and torch.isfinite(w[k]).all() for k in floats)
    assert max(float((w[k] - w1[k]).abs().max()) for k in floats) > 1e-3
    assert [h["round"] for h in ck["history"]] == [0, 1, 2, 3] and res["algorithm"] == "fedncm+ft"
    assert (tmp_path / "amp" / "results.json").is_file() and (tmp_path / "amp" / "figure1.png").is_file()


def _fd(device: str, amp: str = "off", **kw) -> FedDRAOptions:
    fd = FedDRAConfig(rounds=2, steps=2, batch_size=4, dro=DROConfig(rho=1.0), mu=5.0, amp=amp,
                      optimizer="sgd", lr=0.05)
    return FedDRAOptions(fd=fd, image_cut="stem", num_workers=0, progress=False, device=device, **kw)


def test_feddra_on_cuda_matches_cpu(paired, tmp_path, float32_math, no_text_dropout):
    """FedDRA (both stages, DRO weights, the mu constraint) in float32 on CUDA ends at the CPU's
    weights and lambda, up to a few elements (tests/tolerances.py). SGD: see test_feddra's docstring
    for why not Adam. The trained text encoder runs without dropout (no_text_dropout)."""
    root, store = paired
    for name, dev in (("cpu", CPU), ("gpu", GPU)):
        feddra_run(root / "m.json", store, "tiny-staged", vl_doubles.TEXT, tmp_path / name, _fd(dev))
    a, b = _ckpt(tmp_path / "cpu"), _ckpt(tmp_path / "gpu")
    assert a["round"] == b["round"] and a["round"] > 0
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb) and wa
    for k in wa:
        assert_mostly_close(wa[k], wb[k], loose=5e-3, name=k)
    torch.testing.assert_close(a["opt"][0], b["opt"][0], rtol=1e-4, atol=1e-6)  # lambda
    assert a["history"][-1]["lam"] != [1 / 3] * 3


def test_feddra_under_autocast_on_cuda(paired, tmp_path):
    root, store = paired
    res = feddra_run(root / "m.json", store, "tiny-staged", vl_doubles.TEXT, tmp_path / "amp", _fd(GPU, amp="auto"))
    assert res["timing"]["machine"]["device"].startswith(GPU)
    ck = _ckpt(tmp_path / "amp")
    assert all(torch.isfinite(v).all() for v in _weights(ck).values() if v.is_floating_point())
    assert torch.isfinite(ck["opt"][0]).all() and abs(float(ck["opt"][0].sum()) - 1.0) < 1e-6
    assert 0.0 <= res["retrieval"]["t2i_r1"]["mean"]["mean"] <= 100.0

