"""CUDA paths end to end, against the CPU (marked gpu, skipped without CUDA; run on a CUDA
machine by benchmarks/gpu_check.sh): extraction into a store and
`fedheads train` / `predict` with --device cuda. Other checks live beside their code
(test_backbones_sources, test_engine_equivalence (every algorithm, both engines), test_inference,
test_gpu_live (fine-tuning and FedDRA))."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
import torch
from backbone_doubles import write_sur_checkpoint
from click.testing import CliRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_extraction_matches_cpu(tmp_path):
    from embedcache.extraction import ExtractConfig, extract
    from embedcache.store.maintenance import verify_store
    from embedcache.store.reader import load_split, open_store, shard_attributes

    root = d.make_imagefolder(tmp_path / "img", domains=("a", "b"), per_class=4, size=40)
    m = d.make_manifest(root)
    write_sur_checkpoint(tmp_path / "w" / "aircraft-net" / "model_best.pth.tar")
    stores = {}
    for dev in ("cpu", "cuda"):
        stores[dev] = tmp_path / f"{dev}.zarr"
        extract(m, ExtractConfig(backbones=("resnet18-aircraft",), store=str(stores[dev]), device=dev,
                                 weights_dir=str(tmp_path / "w"), batch_size=5, num_workers=2, progress=False),
                source=d.FolderSource(str(root)))
        verify_store(stores[dev])
    for split in ("train", "test"):
        a = load_split(str(stores["cpu"]), ["resnet18-aircraft"], split)
        b = load_split(str(stores["cuda"]), ["resnet18-aircraft"], split)
        assert a.keys() == b.keys() and a
        for c in a:
            assert a[c].sample_ids.tolist() == b[c].sample_ids.tolist()
            np.testing.assert_array_equal(a[c].labels, b[c].labels)
            assert b[c].features.dtype == np.float32 and np.isfinite(b[c].features).all()
            # CUDA runs under autocast (bf16/fp16): same features up to half precision
            np.testing.assert_allclose(b[c].features, a[c].features, rtol=5e-2, atol=5e-2)
    # the device is not part of the cache key: a store built on either is a hit on the other
    ia, ib = open_store(str(stores["cpu"])), open_store(str(stores["cuda"]))
    assert [shard_attributes(ia, s)["cache_key"] for s in ia.shards] == \
        [shard_attributes(ib, s)["cache_key"] for s in ib.shards]


def _store(root: Path) -> Path:
    from embedcache.store.importer import import_features

    rng = np.random.default_rng(0)
    means = rng.normal(size=(4, 16)) * 3.0  # well separated: accuracies do not hinge on the last bit
    store = root / "st.zarr"
    for c in ("c0", "c1", "c2"):
        for split, n in (("train", 40), ("test", 30)):
            y = rng.integers(0, 4, n)
            f = root / f"{c}-{split}.npz"
            np.savez(f, features=(means[y] + rng.normal(size=(n, 16))).astype(np.float32), labels=y)
            import_features(store, f, backbone="synth", client=c, split=split, classes=["a", "b", "c", "d"])
    return store


def test_train_and_predict_on_cuda(tmp_path):
    from fedheads.cli import main

    store = _store(tmp_path)
    res = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / dev
        r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                                      "--rounds", "3", "--seeds", "0", "--device", dev, "--quiet", "--out", str(out)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        res[dev] = json.loads((out / "results.json").read_text())
        assert json.loads((out / "config.json").read_text())["environment"]["cuda"]
    for c, v in res["cpu"]["per_client"].items():
        assert abs(res["cuda"]["per_client"][c]["mean"] - v["mean"]) <= 100.0 / 30 + 1e-9, c  # one sample at most
    pred = tmp_path / "p.csv"
    r = CliRunner().invoke(main, ["predict", "--run", str(tmp_path / "cuda"), "--store", str(store),
                                  "--device", "cuda", "--out", str(pred)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(pred.open()))
    for c, v in res["cuda"]["per_client"].items():
        hits = [row["label"] == row["prediction"] for row in rows if row["client"] == c]
        assert 100.0 * np.mean(hits) == pytest.approx(v["mean"], abs=1e-6), c
