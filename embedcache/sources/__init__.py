"""Image sources (contract 2 in docs/contracts.md): where a manifest's locators point.

    open_source("imagefolder:PATH")     PATH/<domain>/<class>/<image> (Office-Caltech-10, Office-31,
                                        DomainNet, Digit-5 exported as images)
    open_source("jda-digits:FILE.mat")  the MNIST/USPS .mat of the JDA benchmark
    open_source("builtin:digits")       the embedded default (embedcache.sources.builtin_digits)
    open_source("captioned:<spec>")     any of these with a generated caption per image (FedDRA's
                                        paired image-text setting; embedcache.sources.captions)

Every source can `fingerprint(locator, kind)` a sample without decoding it; the manifest keeps
the fingerprints and `embedcache.sources.drift` compares them with the files as they are now.
A source with texts also has `caption_origin` (not None) and `caption(locator)` (contract 2a):
`captioned:` sources, and `imagefolder:` with a `captions.tsv`. `load` returns 8-bit RGB:
`to_rgb8` scales deeper integer pixels rather than letting PIL clip them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from PIL import Image

from embedcache.errors import UserError
from embedcache.manifest import FINGERPRINT_KINDS

__all__ = ["FINGERPRINT_KINDS", "ImageSource", "open_source", "to_rgb8"]


class ImageSource(Protocol):
    spec: str

    def classes(self) -> list[str]: ...
    def domains(self) -> list[str]: ...
    def index(self) -> list[tuple[str, str, int]]: ...
    def load(self, locator: str) -> Image.Image: ...
    def fingerprint(self, locator: str, kind: str = "sha256") -> str: ...
    # optional (contract 2a): caption_origin: str | None; caption(locator) -> str


def open_source(spec: str) -> ImageSource:
    """The source named by `spec` (UserError for an unknown form or a missing path)."""
    kind, sep, arg = spec.partition(":")
    if kind == "imagefolder" and sep:
        from embedcache.sources.imagefolder import ImageFolder

        return ImageFolder(spec, arg)
    if kind == "jda-digits" and sep:
        from embedcache.sources.jda_digits import JDADigits

        return JDADigits(spec, arg)
    if kind == "captioned" and sep:
        from embedcache.sources.captioned import open_captioned

        return open_captioned(spec)
    if spec == "builtin:digits":
        from embedcache.sources.builtin_digits import BuiltinDigits

        return BuiltinDigits()
    raise UserError(f"source {spec!r}: unknown (use imagefolder:PATH, jda-digits:FILE.mat, builtin:digits "
                    f"or captioned:<one of these>)")


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
