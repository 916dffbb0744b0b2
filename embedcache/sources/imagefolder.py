"""`imagefolder:PATH`: PATH/<domain>/<class>/<image>. Classes are the sorted union of the class
folders over all domains (a domain lacking a class is fine); locator = "domain/class/file".

Fingerprints (contract 2): "sha256" = the file's sha256 (the default: reads every byte, a few
percent of decoding the image, benchmarks/results/fingerprint.json; the same on every copy of the
same files); "stat" = f"{size}:{mtime_ns}" (one stat call, opt-in: a copy that does not keep
mtimes looks changed, and an image replaced by another of the same size with its mtime kept,
as `cp -p` or `rsync -t` do, looks unchanged).

File names must be valid UTF-8: a name that is not (bytes from another encoding, which Python
keeps as surrogate escapes) is refused in one line naming it, at partition and wherever a locator
is fingerprinted or loaded, rather than accepted: manifests and feature stores keep locators and
sample ids as UTF-8 text (zarr cannot store such a string), and the same manifest must name the
same file on every machine, which bytes of an unknown encoding do not.

Texts (contract 2a): a file PATH/captions.tsv of `<locator>\t<text>` lines gives the samples user
captions (paired image-text data); without it the source has no texts."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from stat import S_ISREG

from PIL import Image, UnidentifiedImageError

from embedcache.errors import UserError
from embedcache.manifest import locator_problem
from embedcache.pixels import to_rgb8

CAPTIONS_FILE = "captions.tsv"
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
                for f in files:
                    self._check_name(f"{d.name}/{c.name}/{f}")
                if files:
                    classes[c.name] = files
            if classes:
                doms[d.name] = classes
        if not doms:
            raise UserError(f"{self.spec}: no <domain>/<class>/<image> files under {self.root}")
        return doms

    def domains(self) -> list[str]:
        return list(self._layout)

    @functools.cached_property
    def _captions(self) -> tuple[str | None, dict[str, str]]:
        path = self.root / CAPTIONS_FILE
        if not path.is_file():
            return None, {}
        return read_captions_tsv(path)

    @property
    def caption_origin(self) -> str | None:
        """"captions.tsv:<sha256[:16]>" when PATH/captions.tsv exists, else None (no texts)."""
        return self._captions[0]

    def caption(self, locator: str) -> str:
        origin, texts = self._captions
        if origin is None:
            raise UserError(f"{locator}: {self.spec} has no texts (no {self.root / CAPTIONS_FILE}; "
                            f"captioned:{self.spec} generates captions)")
        if locator not in texts:
            raise UserError(f"{locator}: no caption in {self.root / CAPTIONS_FILE}")
        return texts[locator]

    def unknown_caption_locators(self) -> list[str]:
        """Locators of captions.tsv that name no image of this folder (likely typos)."""
        known = {loc for _, loc, _ in self.index()}
        return sorted(loc for loc in self._captions[1] if loc not in known)

    def classes(self) -> list[str]:
        return sorted({c for cl in self._layout.values() for c in cl})

    def index(self) -> list[tuple[str, str, int]]:
        cid = {c: i for i, c in enumerate(self.classes())}
        return [(d, f"{d}/{c}/{f}", cid[c]) for d, cl in self._layout.items() for c, files in cl.items() for f in files]

    def _check_name(self, locator: str) -> None:
        """UserError naming `locator` (its bytes) when it is not valid UTF-8 (see the module doc)."""
        try:
            locator.encode("utf-8")
        except UnicodeEncodeError:
            try:
                shown = repr(os.fsencode(locator))  # the bytes on disk, e.g. b'a/cat/caf\xe9.jpg'
            except UnicodeError:  # a surrogate no file name decodes to (a hand-written manifest)
                shown = ascii(locator)
            raise UserError(f"{self.spec}: file name {shown} is not valid UTF-8; rename it "
                            f"(manifests and stores keep names as UTF-8 text), e.g. with convmv") from None

    def _path(self, locator: str) -> Path:
        self._check_name(locator)
        if locator_problem(locator):  # absolute or with '..': outside the folder
            raise UserError(f"{locator}: locator escapes {self.root}")
        path = self.root / locator
        if not path.is_file():
            raise UserError(f"{locator}: image file missing under {self.root}")
        return path

    def fingerprint(self, locator: str, kind: str = "sha256") -> str:
        if kind == "stat":  # one stat call: this runs for every image on every extract
            self._check_name(locator)
            if locator_problem(locator):
                raise UserError(f"{locator}: locator escapes {self.root}")
            try:
                st = os.stat(os.path.join(self.root, locator))
            except OSError:
                st = None
            if st is None or not S_ISREG(st.st_mode):
                raise UserError(f"{locator}: image file missing under {self.root}")
            return f"{st.st_size}:{st.st_mtime_ns}"
        path = self._path(locator)
        if kind == "sha256":
            return hashlib.sha256(path.read_bytes()).hexdigest()  # images are small: one read
        raise UserError(f"fingerprint kind {kind!r}: must be stat or sha256")

    def load(self, locator: str) -> Image.Image:
        path = self._path(locator)
        try:
            with Image.open(path) as im:
                im.load()
                rgb = to_rgb8(im, locator)
                return im.copy() if rgb is im else rgb  # a plain image, detached from the file
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise UserError(f"{locator}: unreadable or corrupt image ({type(exc).__name__}: {exc})") from None


def read_captions_tsv(path: Path) -> tuple[str, dict[str, str]]:
    """("captions.tsv:<sha256[:16]>", {locator: text}) from `<locator>\t<text>` lines (UTF-8; an
    optional header `locator\ttext`; blank and `#` lines skipped). UserError naming the line for a
    line without a tab, an empty text or a locator given twice."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#") or (n == 1 and line.strip() == "locator\ttext"):
            continue
        loc, tab, caption = line.partition("\t")
        loc, caption = loc.strip(), caption.strip()
        if not tab or not loc:
            raise UserError(f"{path}:{n}: expected <locator><TAB><text>, got {line[:80]!r}")
        if not caption:
            raise UserError(f"{path}:{n}: {loc} has an empty caption")
        if loc in out:
            raise UserError(f"{path}:{n}: {loc} has a caption already (one line per image)")
        out[loc] = caption
    return f"{CAPTIONS_FILE}:{hashlib.sha256(raw).hexdigest()[:16]}", out
