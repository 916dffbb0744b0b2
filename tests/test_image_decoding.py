"""Images as `imagefolder:` decodes them: deeper-than-8-bit pixels are scaled to 8-bit RGB, not
clipped to white; file names that are not UTF-8 are refused in one line naming them."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
from click.testing import CliRunner
from PIL import Image

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.sources import open_source

# every 16-bit value class: 0, a ramp through the middle, and full white
RAMP = np.concatenate([[0, 1, 128, 129, 256, 257, 32767, 32768, 65534, 65535],
                       np.linspace(0, 65535, 54).round()]).astype(np.uint16).reshape(8, 8)


def _expected(v: np.ndarray) -> np.ndarray:
    return np.round(v.astype(np.float64) / 257.0).astype(np.uint8)


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "imgs"
    (root / "a" / "cat").mkdir(parents=True)
    return root


def _png16(path: Path, px: np.ndarray, color_type: int) -> None:
    """A 16-bit PNG written from numpy (PIL writes 16-bit greyscale only)."""
    h, w = px.shape[:2]
    raw = b"".join(b"\x00" + px[y].astype(">u2").tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_16bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    root = _folder(tmp_path)
    Image.fromarray(RAMP).save(root / "a" / "cat" / "g.png")  # PIL writes mode I;16 as a 16-bit PNG
    with Image.open(root / "a" / "cat" / "g.png") as im:
        assert im.mode == "I;16" and np.array_equal(np.asarray(im), RAMP)  # really 16-bit on disk
    img = open_source(f"imagefolder:{root}").load("a/cat/g.png")
    assert img.mode == "RGB"
    px = np.asarray(img)
    for ch in range(3):
        assert np.array_equal(px[..., ch], _expected(RAMP))


def test_16bit_pgm_read_by_pil_as_mode_i_is_scaled(tmp_path):
    root = _folder(tmp_path)
    (root / "a" / "cat" / "g.pgm").write_bytes(b"P5 8 8 65535\n" + RAMP.astype(">u2").tobytes())
    with Image.open(root / "a" / "cat" / "g.pgm") as im:
        assert im.mode == "I"
    px = np.asarray(open_source(f"imagefolder:{root}").load("a/cat/g.pgm"))
    assert np.array_equal(px[..., 1], _expected(RAMP))


@pytest.mark.parametrize("alpha", [False, True])
def test_16bit_rgb_png_keeps_its_colours(tmp_path, alpha):
    root = _folder(tmp_path)
    rgb = np.stack([RAMP, 65535 - RAMP, np.full_like(RAMP, 1000)] + ([np.full_like(RAMP, 65535)] if alpha else []),
                   -1)
    _png16(root / "a" / "cat" / "c.png", rgb, 6 if alpha else 2)
    px = np.asarray(open_source(f"imagefolder:{root}").load("a/cat/c.png")).astype(int)
    assert px.shape == (8, 8, 3)
    # PIL keeps each sample's high byte (v >> 8); round(v / 257) differs from it by at most 1
    assert np.abs(px - _expected(rgb[..., :3]).astype(int)).max() <= 1
    assert np.array_equal(px[..., 2], np.full((8, 8), 3))


def test_direct_i16_images_reach_backbones_scaled():
    from embedcache.sources import to_rgb8

    img = Image.fromarray(RAMP)
    assert img.mode == "I;16"
    assert np.array_equal(np.asarray(to_rgb8(img))[..., 0], _expected(RAMP))
    from embedcache.backbones.base import _to_rgb

    assert np.array_equal(np.asarray(_to_rgb(img))[..., 2], _expected(RAMP))


def test_float_image_is_refused_naming_it(tmp_path):
    root = _folder(tmp_path)
    Image.fromarray((RAMP / 65535).astype(np.float32), "F").save(root / "a" / "cat" / "f.tif")
    with pytest.raises(UserError, match=r"^a/cat/f\.tif: 32-bit float pixels have no defined white level"):
        open_source(f"imagefolder:{root}").load("a/cat/f.tif")


BAD = b"caf\xe9.png"  # Latin-1 bytes: not UTF-8


def _non_utf8_folder(tmp_path: Path) -> Path:
    root = d.make_imagefolder(tmp_path / "imgs", per_class=3)
    try:
        Image.new("RGB", (10, 10), (9, 9, 9)).save(os.path.join(os.fsencode(root / "a" / "cat"), BAD))
    except (OSError, UnicodeError):
        pytest.skip("this file system does not take non-UTF-8 file names")
    return root


@pytest.mark.skipif(sys.platform in ("darwin", "win32"), reason="file names are always Unicode there")
def test_non_utf8_file_name_is_refused_at_partition_naming_it(tmp_path):
    root = _non_utf8_folder(tmp_path)
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{root}", "--scheme", "feature-shift",
                                    "--train-per-class", "1", "--out", str(out)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "file name b'a/cat/caf\\xe9.png' is not valid UTF-8; rename it" in res.output, res.output
    assert not out.exists()


@pytest.mark.skipif(sys.platform in ("darwin", "win32"), reason="file names are always Unicode there")
def test_manifest_with_a_non_utf8_locator_is_refused_before_any_store_write(tmp_path):
    """As an older partition wrote it (the name kept as a surrogate escape in the JSON)."""
    root = _non_utf8_folder(tmp_path)
    loc = "a/cat/" + os.fsdecode(BAD)
    ok = "a/cat/img_0.png"
    st = os.stat(os.path.join(os.fsencode(root / "a" / "cat"), BAD))
    fp = {ok: open_source(f"imagefolder:{root}").fingerprint(ok, "stat"), loc: f"{st.st_size}:{st.st_mtime_ns}"}
    doc = {"format": "embedcache-manifest/1", "source": f"imagefolder:{root}", "classes": ["cat"], "seed": 0,
           "recipe": {"scheme": "hand", "fingerprint": "stat"}, "report": {},
           "clients": [{"name": "c0-a", "domain": "a", "train": [[ok, ok, 0, fp[ok]], [loc, loc, 0, fp[loc]]],
                        "test": []}]}
    m = tmp_path / "m.json"
    m.write_text(json.dumps(doc))  # ensure_ascii: the surrogate is written as \udce9
    store = tmp_path / "s"
    res = CliRunner().invoke(main, ["extract", "--manifest", str(m), "--backbones", "tiny", "--store", str(store),
                                    "--plugin", "store_doubles", "--quiet"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "internal error" not in res.output and "b'a/cat/caf\\xe9.png' is not valid UTF-8" in res.output
    assert not store.exists()


def test_a_locator_no_file_name_decodes_to_is_named_too(tmp_path):
    src = open_source(f"imagefolder:{_folder(tmp_path)}")
    for kind in ("sha256", "stat"):
        with pytest.raises(UserError, match=r"file name 'a/cat/\\ud800\.png' is not valid UTF-8"):
            src.fingerprint("a/cat/\ud800.png", kind)
    with pytest.raises(UserError, match=r"is not valid UTF-8"):
        src.load("a/cat/\ud800.png")
