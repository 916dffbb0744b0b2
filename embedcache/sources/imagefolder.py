"""`imagefolder:PATH`: PATH/<domain>/<class>/<image>. Classes are the sorted union of the class
folders over all domains (a domain lacking a class is fine); locator = "domain/class/file"."""

from __future__ import annotations

import functools
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from embedcache.errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


class ImageFolder:
    def __init__(self, spec: str, path: str) -> None:
        self.spec = spec
        self.root = Path(path)
        if not self.root.is_dir():
            raise UserError(f"{spec}: folder {self.root} not found")

    @functools.cached_property
    def _layout(self) -> dict[str, dict[str, list[str]]]:
        doms: dict[str, dict[str, list[str]]] = {}
        for d in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            classes = {}
            for c in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
                files = sorted(f.name for f in c.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
                if files:
                    classes[c.name] = files
            if classes:
                doms[d.name] = classes
        if not doms:
            raise UserError(f"{self.spec}: no <domain>/<class>/<image> files under {self.root}")
        return doms

    def domains(self) -> list[str]:
        return list(self._layout)

    def classes(self) -> list[str]:
        return sorted({c for cl in self._layout.values() for c in cl})

    def index(self) -> list[tuple[str, str, int]]:
        cid = {c: i for i, c in enumerate(self.classes())}
        return [(d, f"{d}/{c}/{f}", cid[c]) for d, cl in self._layout.items() for c, files in cl.items() for f in files]

    def load(self, locator: str) -> Image.Image:
        path = self.root / locator
        if ".." in Path(locator).parts:
            raise UserError(f"{locator}: locator escapes {self.root}")
        if not path.is_file():
            raise UserError(f"{locator}: image file missing under {self.root}")
        try:
            with Image.open(path) as im:
                im.load()
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise UserError(f"{locator}: unreadable or corrupt image ({type(exc).__name__}: {exc})") from None
