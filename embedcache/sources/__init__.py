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

from PIL import Image

from embedcache.errors import UserError
from embedcache.manifest import FINGERPRINT_KINDS
from embedcache.pixels import to_rgb8

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
        from embedcache.sources.captioned import CaptionedSource, inner_spec

        return CaptionedSource(spec, open_source(inner_spec(spec)))
    if spec == "builtin:digits":
        from embedcache.sources.builtin_digits import BuiltinDigits

        return BuiltinDigits()
    raise UserError(f"source {spec!r}: unknown (use imagefolder:PATH, jda-digits:FILE.mat, builtin:digits "
                    f"or captioned:<one of these>)")
