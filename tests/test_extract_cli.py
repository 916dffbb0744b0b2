"""`embedcache extract` command line: bad input is one line and exit 2."""

from __future__ import annotations

from click.testing import CliRunner

from embedcache.cli import main


def test_missing_manifest_is_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["extract", "--manifest", str(tmp_path / "nope.json"), "--backbones", "x",
                                    "--store", str(tmp_path / "s")])
    assert res.exit_code == 2 and res.output.strip() == f"error: {tmp_path / 'nope.json'}: manifest file not found"
    assert not (tmp_path / "s").exists()


def test_bad_scheduler_and_plugin(tmp_path):
    m = tmp_path / "m.json"
    m.write_text("{}")
    res = CliRunner().invoke(main, ["extract", "--manifest", str(m), "--backbones", "x", "--store", str(tmp_path / "s"),
                                    "--plugin", "no_such_module_xyz"])
    assert res.exit_code == 2 and "plugin no_such_module_xyz: cannot import" in res.output


def _partition(root, out):
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{root}", "--scheme", "feature-shift",
                                    "--train-per-class", "2", "--test-per-class", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output


def test_partition_extract_inspect_verify_end_to_end(tmp_path):
    import json

    import store_doubles as d

    from embedcache.manifest import load_manifest
    from embedcache.store.reader import load_split

    root = d.make_imagefolder(tmp_path / "imgs")
    _partition(root, tmp_path / "m.json")
    m = load_manifest(tmp_path / "m.json")
    store = str(tmp_path / "s")
    args = ["extract", "--manifest", str(tmp_path / "m.json"), "--backbones", "tiny,tiny2", "--store", store,
            "--plugin", "store_doubles", "--batch-size", "2", "--chunk-rows", "2", "--quiet"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = load_split(store, ["tiny", "tiny2"], "train")
    assert sorted(out) == sorted(c.name for c in m.clients)
    for c in m.clients:
        assert list(out[c.name].sample_ids) == [s.id for s in c.train] and out[c.name].features.shape[1] == 8
    assert CliRunner().invoke(main, ["verify", store]).exit_code == 0
    rep = json.loads(CliRunner().invoke(main, ["inspect", store, "--json"]).output)
    assert rep["complete"] and len(rep["shards"]) == 4 * len(m.clients)
    res = CliRunner().invoke(main, args)  # cache hit
    assert res.exit_code == 0 and "(8 cache hits), 0 chunks" in res.output


def test_cli_bad_input_one_line_exit_2(tmp_path):
    import store_doubles as d

    from embedcache.manifest import load_manifest
    from embedcache.store.reader import open_store

    root = d.make_imagefolder(tmp_path / "imgs")
    _partition(root, tmp_path / "m.json")
    victim = load_manifest(tmp_path / "m.json").clients[0].train[0].locator
    (root / victim).write_bytes(b"garbage, not a png")
    base = ["extract", "--manifest", str(tmp_path / "m.json"), "--store", str(tmp_path / "s"), "--plugin",
            "store_doubles", "--quiet"]
    # changed since the manifest was written: refused before any store exists
    res = CliRunner().invoke(main, base + ["--backbones", "tiny"])
    assert res.exit_code == 2 and victim in res.output and res.output.count("\n") == 1, res.output
    assert "changed since the manifest was written" in res.output and not (tmp_path / "s").exists()
    # recorded as it is now, the image still cannot be decoded: one line, no complete shard
    _partition(root, tmp_path / "m.json")
    res = CliRunner().invoke(main, base + ["--backbones", "tiny"])
    assert res.exit_code == 2 and victim in res.output and res.output.count("\n") == 1, res.output
    assert "cannot read" in res.output or "corrupt" in res.output, res.output
    assert not all(s.complete for s in open_store(tmp_path / "s").shards)
    res = CliRunner().invoke(main, base + ["--backbones", "no-such-net"])
    assert res.exit_code == 2 and "no-such-net: unknown backbone" in res.output


def test_backbones_default_is_what_embedcache_backbones_prints(tmp_path, monkeypatch):
    import store_doubles as d

    import embedcache.backbones as B
    from embedcache.commands.extract import _expand_default
    from embedcache.store.reader import open_store

    (tmp_path / "w" / "cifar10_resnet").mkdir(parents=True)
    from embedcache.backbones.cifar_resnet import CHECKPOINTS

    (tmp_path / "w" / "cifar10_resnet" / CHECKPOINTS[20][0]).write_bytes(b"x")
    assert _expand_default(("default",), str(tmp_path / "w")) == ("resnet20-cifar10",)
    assert _expand_default(("tiny", "default", "resnet20-cifar10"), str(tmp_path / "w")) == ("tiny", "resnet20-cifar10")
    root = d.make_imagefolder(tmp_path / "imgs")
    _partition(root, tmp_path / "m.json")
    monkeypatch.setattr(B, "default_backbones_with_reason", lambda wd=None: (["tiny"], "a test's choice"))
    res = CliRunner().invoke(main, ["extract", "--manifest", str(tmp_path / "m.json"), "--backbones", "default",
                                    "--store", str(tmp_path / "s"), "--plugin", "store_doubles", "--quiet"])
    assert res.exit_code == 0, res.output
    assert res.output.count("backbones: default = tiny (a test's choice)") == 1
    assert open_store(tmp_path / "s").backbones == ("tiny",)
