"""A store whose root metadata is damaged or lost is one line saying how to rebuild it, and
`embedcache verify --repair` rebuilds it from the intact shards; a write the file system refuses
(disk full, read-only, no permission) is one line naming the path and what to do."""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
from click.testing import CliRunner
from store_doubles import assert_one_line

from embedcache.cli import main as ec
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import save_manifest
from embedcache.store import writer as st
from embedcache.store.importer import import_features
from embedcache.store.reader import load_split, open_store


@pytest.fixture
def made(tmp_path) -> tuple[Path, Path, Path]:
    """(images, manifest file, store) after one extraction of `tiny`."""
    images = d.make_imagefolder(tmp_path / "imgs", per_class=3)
    m = d.make_manifest(images)
    src = d.FolderSource(str(images))  # fingerprinted, as partition writes it (no note about drift)
    def printed(samples: tuple) -> tuple:
        return tuple(replace(s, fingerprint=src.fingerprint(s.locator, "sha256")) for s in samples)
    m = replace(m, recipe={**m.recipe, "fingerprint": "sha256"},
                clients=tuple(replace(c, train=printed(c.train), test=printed(c.test)) for c in m.clients))
    save_manifest(m, tmp_path / "m.json")
    store = tmp_path / "s"
    cfg = ExtractConfig(backbones=("tiny",), store=str(store), progress=False, num_workers=1, batch_size=2)
    extract(m, cfg, source=d.FolderSource(str(images)), backbone_factory=d.tiny_factory)
    return images, tmp_path / "m.json", store


def _extract_cli(made):
    _, manifest, store = made
    return CliRunner().invoke(ec, ["extract", "--manifest", str(manifest), "--backbones", "tiny", "--store", str(store),
                                   "--plugin", "store_doubles", "--quiet", "--batch-size", "2"])


def test_a_truncated_root_is_one_line_and_verify_repair_rebuilds_it(made):
    _, _, store = made
    before = load_split(store, "tiny", "train")
    root = store / "zarr.json"
    text = root.read_text()
    root.write_text(text[: len(text) // 2])  # cut inside the consolidated metadata
    assert_one_line(_extract_cli(made), 2, f"{root}: unreadable", f"embedcache verify --repair {store}")
    assert_one_line(CliRunner().invoke(ec, ["inspect", str(store)]), 2, "verify --repair")
    res = CliRunner().invoke(ec, ["verify", "--repair", str(store)])
    assert res.exit_code == 0, res.output
    assert f"repaired: root metadata {root} rebuilt from 4 shard(s)" in res.output
    after = load_split(store, "tiny", "train")
    assert sorted(after) == sorted(before) and all(np.array_equal(after[c].features, before[c].features) for c in before)
    res = _extract_cli(made)
    assert res.exit_code == 0 and "4 cache hits" in res.output, res.output  # nothing to recompute


def test_a_lost_root_needs_the_manifest_and_is_rebuilt_from_it(made):
    _, manifest, store = made
    hash_before = open_store(store).manifest_hash
    (store / "zarr.json").unlink()
    assert_one_line(_extract_cli(made), 2, "zarr.json: missing", "verify --repair")
    assert_one_line(CliRunner().invoke(ec, ["verify", "--repair", str(store)]), 2,
                    "class names cannot be recovered", "--manifest")
    res = CliRunner().invoke(ec, ["verify", "--repair", str(store), "--manifest", str(manifest)])
    assert res.exit_code == 0 and "rebuilt from 4 shard(s) and the manifest" in res.output, res.output
    info = open_store(store)
    assert info.manifest_hash == hash_before and info.classes == ("cat", "dog", "emu")
    assert info.clients == ("c-a", "c-b") and all(s.current for s in info.shards)


def test_a_store_that_is_fine_is_left_alone_by_repair(made):
    _, _, store = made
    before = (store / "zarr.json").read_bytes()
    res = CliRunner().invoke(ec, ["verify", "--repair", str(store)])
    assert res.exit_code == 0 and "repaired" not in res.output and (store / "zarr.json").read_bytes() == before


@pytest.mark.parametrize("code, needle", [(errno.EROFS, "the file system is read-only: choose another --store"),
                                          (errno.EACCES, "fix its permissions or choose another --store"),
                                          (errno.ENOSPC, "free space on that disk")])
def test_a_refused_write_during_extract_is_one_line_naming_the_path(made, monkeypatch, code, needle):
    _, _, store = made
    shard = store / "tiny" / "c-a" / "train"

    def refused(*a, **k):
        raise OSError(code, os.strerror(code), str(shard / "zarr.json"))

    monkeypatch.setattr(st, "prepare_shard", refused)
    assert_one_line(_extract_cli(made), 2, f"{shard / 'zarr.json'}: cannot write ({os.strerror(code)})", needle)


def test_other_os_errors_are_not_swallowed(made, monkeypatch):
    def broken(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(st, "prepare_shard", broken)
    images, manifest, store = made
    cfg = ExtractConfig(backbones=("tiny",), store=str(store), progress=False, num_workers=1, batch_size=2)
    with pytest.raises(OSError, match="Input/output error"):
        extract(str(manifest), cfg, source=d.FolderSource(str(images)), backbone_factory=d.tiny_factory)


def test_a_read_only_store_is_one_line(made, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod does not stop root's writes (the monkeypatched EROFS/EACCES cases cover it)")
    _, _, store = made
    np.savez(tmp_path / "f.npz", features=np.ones((3, 4), np.float32), labels=np.array([0, 1, 2]))
    modes = {p: p.stat().st_mode for p in [store, *store.rglob("*")]}
    for p in modes:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        res = CliRunner().invoke(ec, ["import", "--store", str(store), "--backbone", "ext", "--client", "c-a",
                                      "--split", "train", str(tmp_path / "f.npz")])
        assert_one_line(res, 2, "cannot write (Permission denied)", "choose another --store")
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_a_full_disk_during_gc_is_one_line(made, monkeypatch):
    _, _, store = made
    from embedcache.store import maintenance

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(store / "zarr.json"))

    monkeypatch.setattr(maintenance, "consolidate", full)
    assert_one_line(CliRunner().invoke(ec, ["rm", str(store), "--backbone", "tiny", "--client", "c-a"]), 2,
                    "zarr.json: cannot write (No space left on device)", "free space")


def test_import_into_a_store_with_a_damaged_root_says_how_to_rebuild(made, tmp_path):
    _, _, store = made
    (store / "zarr.json").write_text("{")
    np.savez(tmp_path / "f.npz", features=np.ones((3, 4), np.float32), labels=np.array([0, 1, 2]))
    with pytest.raises(UserError, match="verify --repair"):
        import_features(store, tmp_path / "f.npz", backbone="ext", client="c9", split="train")


def test_a_refused_write_outside_the_store_is_not_called_the_stores(tmp_path):
    """A weights file or cache that cannot be written is not the store's fault: the error passes
    through unchanged (the CLI names it), rather than advising another --store."""
    from embedcache.store.layout import store_writes

    store = tmp_path / "s.zarr"
    with pytest.raises(PermissionError), store_writes(store):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "weights" / "w.pt"))
    with pytest.raises(UserError, match=r"s.zarr/c0/zarr.json: cannot write \(Permission denied\); fix its permissions"), \
            store_writes(store):
        raise PermissionError(errno.EACCES, "Permission denied", str(store / "c0" / "zarr.json"))
