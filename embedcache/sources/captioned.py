"""`captioned:<inner spec>`: any image source with a generated caption per image (contract 2a).

Everything but the texts is the inner source's (classes, domains, index, images, fingerprints),
so a captioned manifest's image features are those of the same images under the inner spec;
`caption(locator)` is `captions.caption_for(image, class name, domain)`.
"""

from __future__ import annotations

import functools

from PIL import Image

from embedcache.errors import UserError
from embedcache.sources.captions import CAPTION_VERSION, caption_for

PREFIX = "captioned:"


class CaptionedSource:
    def __init__(self, spec: str, inner: object) -> None:
        self.spec = spec
        self.inner = inner
        self.caption_origin = f"generated/{CAPTION_VERSION}"

    @functools.cached_property
    def _where(self) -> dict[str, tuple[str, str]]:
        """locator -> (class name, domain), from the inner index."""
        classes = self.inner.classes()
        return {loc: (classes[lab], dom) for dom, loc, lab in self.inner.index()}

    def classes(self) -> list[str]:
        return self.inner.classes()

    def domains(self) -> list[str]:
        return self.inner.domains()

    def index(self) -> list[tuple[str, str, int]]:
        return self.inner.index()

    def load(self, locator: str) -> Image.Image:
        return self.inner.load(locator)

    def fingerprint(self, locator: str, kind: str = "sha256") -> str:
        return self.inner.fingerprint(locator, kind)

    def caption(self, locator: str) -> str:
        where = self._where.get(locator)
        if where is None:
            raise UserError(f"{locator}: not a sample of {self.inner.spec}")
        return caption_for(self.inner.load(locator), *where)


def inner_spec(spec: str) -> str:
    """The image source `captioned:<inner spec>` wraps (UserError when there is none, or it is
    itself captioned)."""
    inner = spec[len(PREFIX):]
    if not inner or inner.startswith(PREFIX):
        raise UserError(f"source {spec!r}: captioned:<source> wraps one image source, e.g. "
                        f"captioned:imagefolder:PATH")
    return inner
