"""Decoded images as 8-bit RGB, whatever their bit depth (the one place pixels are normalised
before a backbone's transform: image folders, the backbones' own transforms, predict's images)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from embedcache.errors import UserError


def _white_level(img: Image.Image) -> int:
    """The sample value that means full intensity for PIL's integer modes: 65535 for I;16*
    (16-bit PNG, TIFF, PGM) and for I (PIL's 16-bit PGM and 16-bit data read as 32-bit ints),
    except a TIFF whose BitsPerSample says another depth (e.g. 12 -> 4095, 32 -> 2**31 - 1)."""
    bits = 16
    tags = getattr(img, "tag_v2", None)
    if img.mode == "I" and tags is not None and tags.get(258):
        per_sample = tags.get(258)
        bits = int(per_sample[0] if isinstance(per_sample, tuple) else per_sample)
    return 2 ** min(bits, 31) - 1


def to_rgb8(img: Image.Image, name: str = "image") -> Image.Image:
    """`img` as 8-bit RGB. PIL's convert("RGB") clips integer samples above 255, so a 16-bit
    greyscale PNG (mode I;16) would read as all white: integer modes deeper than 8 bits are
    scaled first, value * 255 / white level rounded (round(v / 257) for 16 bits). PIL already
    decodes 16-bit RGB(A) PNGs to 8-bit RGB(A). Float pixels (mode F) have no white level:
    UserError naming `name`."""
    if img.mode == "RGB":
        return img
    if img.mode == "F":
        raise UserError(f"{name}: 32-bit float pixels have no defined white level; save it as 8- or 16-bit")
    if img.mode.startswith("I"):  # I, I;16, I;16B, I;16L, I;16N, I;16S
        white = _white_level(img)
        px = np.clip(np.asarray(img).astype(np.int64), 0, white)
        img = Image.fromarray(((px * 255 + white // 2) // white).astype(np.uint8), "L")
    return img.convert("RGB")
