"""Deterministic captions from an image's pixels, its class and its domain (docs/contracts.md 2a).

FedDRA (federated distributionally robust vision-language alignment) aligns images with the
reports written about them. Offline, Office-Caltech-10 has no reports, so, as the FedDRA reading
notes propose (sections 3-4), each image gets a caption written from what can be read off its
pixels: "3 synonyms per class, 4 sentence templates, a domain phrase, colour / background /
orientation read from the pixels, chosen deterministically per image". The attributes:
- orientation from the aspect ratio w/h;
- background from the luminance of a border strip (mostly white, mostly dark, uniform, or not);
- colour as the nearest of 9 named RGB values to the mean colour of the central third;
- lighting from the mean luminance.
The synonym and the template are picked by a hash of (version, class, domain, size, pixels), so
two copies of one image get one caption and nothing depends on file names or order.

CAPTION_VERSION is recorded as the sources' caption_origin ("generated/<version>", then the
manifest's recipe["captions"]); bump it with any change that may change a caption.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from embedcache.errors import UserError

CAPTION_VERSION = 1

# Office-Caltech-10: three ways to name each class (used as "a {colour} {noun}"; "{colour}"
# inside a synonym marks where the colour goes).
CLASS_SYNONYMS: dict[str, tuple[str, str, str]] = {
    "backpack": ("backpack", "rucksack", "school bag"),
    "bike": ("bike", "bicycle", "push bike"),
    "calculator": ("calculator", "pocket calculator", "desk calculator"),
    "headphones": ("pair of {colour} headphones", "{colour} headset", "pair of {colour} earphones"),
    "keyboard": ("keyboard", "computer keyboard", "typing keyboard"),
    "laptop": ("laptop", "notebook computer", "portable computer"),
    "monitor": ("monitor", "computer screen", "flat-panel display"),
    "mouse": ("mouse", "computer mouse", "pointing device"),
    "mug": ("mug", "coffee mug", "cup"),
    "projector": ("projector", "video projector", "beamer"),
}
# One phrase per domain: Office-Caltech-10, DomainNet, the digit domains of builtin:digits /
# jda-digits; any other domain reads "<domain> image".
DOMAIN_PHRASES: dict[str, str] = {
    "amazon": "online product photo", "caltech10": "web photograph", "dslr": "high-resolution dslr photo",
    "webcam": "low-resolution webcam shot",
    "clipart": "clip-art image", "infograph": "infographic", "painting": "painting", "quickdraw": "quick doodle",
    "real": "photograph", "sketch": "pencil sketch",
    "mnist": "handwritten scan", "usps": "postal scan", "mnistm": "colour-blended scan", "synth": "rendered image",
    "uci": "coarse scan", "svhn": "street number photo", "syn": "rendered image",
}
TEMPLATES: tuple[str, ...] = (
    "a {lighting}, {orientation} {domain} of {thing} on a {background} background",
    "{thing} against a {background} background in a {lighting} {orientation} {domain}",
    "{orientation} {domain}: {thing}, {lighting} light, {background} background",
    "there is {thing} in this {lighting} {orientation} {domain}, set on a {background} background",
)
# Nearest-name colour (RGB, 0..255) of the central third.
COLOURS: dict[str, tuple[int, int, int]] = {
    "black": (20, 20, 20), "white": (235, 235, 235), "grey": (128, 128, 128), "red": (200, 30, 30),
    "orange": (230, 130, 30), "yellow": (220, 200, 40), "green": (40, 150, 60), "blue": (40, 80, 190),
    "brown": (120, 80, 40),
}
_COLOUR_NAMES = tuple(COLOURS)
_COLOUR_RGB = np.array([COLOURS[c] for c in _COLOUR_NAMES], np.float64) / 255.0
BORDER = 0.05  # border strip: this share of the shorter side (at least one pixel)
WIDE = 1.2  # w/h above: landscape; below 1/WIDE: portrait


def _luma(rgb: np.ndarray) -> np.ndarray:
    """ITU-R BT.601 luma of [..., 3] values in [0, 1]."""
    return rgb @ np.array([0.299, 0.587, 0.114])


def attributes(img: Image.Image) -> dict[str, str]:
    """orientation, background, colour and lighting of an image (see the module docstring)."""
    px = np.asarray(img.convert("RGB"), dtype=np.float64) / 255.0
    h, w = px.shape[:2]
    ratio = w / h
    orientation = "landscape" if ratio > WIDE else "portrait" if ratio < 1 / WIDE else "square"
    b = max(1, int(round(BORDER * min(h, w))))
    border = np.concatenate([px[:b].reshape(-1, 3), px[-b:].reshape(-1, 3),
                             px[b:-b, :b].reshape(-1, 3), px[b:-b, -b:].reshape(-1, 3)])
    y = _luma(border)
    if (y > 0.88).mean() >= 0.6:
        background = "white"
    elif (y < 0.15).mean() >= 0.6:
        background = "dark"
    elif y.std() < 0.1:
        background = "plain"
    else:
        background = "cluttered"
    centre = px[h // 3: max(h // 3 + 1, 2 * h // 3), w // 3: max(w // 3 + 1, 2 * w // 3)].reshape(-1, 3).mean(0)
    colour = _COLOUR_NAMES[int(np.argmin(((_COLOUR_RGB - centre) ** 2).sum(1)))]
    mean_y = float(_luma(px).mean())
    lighting = "dim" if mean_y < 0.35 else "bright" if mean_y > 0.65 else "soft"
    return {"orientation": orientation, "background": background, "colour": colour, "lighting": lighting}


def synonyms(class_name: str) -> tuple[str, ...]:
    """Three names for a class: Office-Caltech-10's own, "digit N" for digit classes, else the
    class name itself (underscores and dashes read as spaces)."""
    if class_name in CLASS_SYNONYMS:
        return CLASS_SYNONYMS[class_name]
    if class_name.isdigit():
        return (f"digit {class_name}", f"number {class_name}", f"numeral {class_name}")
    return (re.sub(r"[_\-]+", " ", class_name).strip() or class_name,)


def domain_phrase(domain: str) -> str:
    return DOMAIN_PHRASES.get(domain) or f"{re.sub(r'[_-]+', ' ', domain).strip() or 'unnamed'} image"


def _article(phrase: str) -> str:
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase


def caption_for(img: Image.Image, class_name: str, domain: str) -> str:
    """The caption of one image (pure: same pixels, class and domain -> same text)."""
    rgb = img.convert("RGB")
    attrs = attributes(rgb)
    h = hashlib.sha256(f"captions/{CAPTION_VERSION}|{class_name}|{domain}|{rgb.size}|".encode())
    h.update(rgb.tobytes())
    k = int.from_bytes(h.digest()[:8], "big")
    names = synonyms(class_name)
    noun = names[k % len(names)]
    thing = noun.format(colour=attrs["colour"]) if "{colour}" in noun else f"{attrs['colour']} {noun}"
    template = TEMPLATES[(k // 3) % len(TEMPLATES)]
    return template.format(thing=_article(thing), domain=domain_phrase(domain), **attrs)


def caption_all(caption: Callable[[str], str], locators: Sequence[str], *,
                workers: int | None = None, desc: str = "captions") -> list[str | UserError]:
    """caption(locator) for every locator, in order, in threads (decoding releases the GIL); a
    sample that cannot be captioned gives its UserError instead (the caller decides)."""
    from embedcache.progress import bar as tqdm

    def one(loc: str) -> str | UserError:
        try:
            return caption(loc)
        except UserError as exc:
            return exc
        except OSError as exc:
            return UserError(f"{loc}: unreadable ({exc.strerror or exc})")

    n = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(n, thread_name_prefix="embedcache-caption") as pool, \
            tqdm(total=len(locators), desc=desc, unit="img", disable=None, leave=False) as bar:
        out = []
        for r in pool.map(one, locators, chunksize=16):
            out.append(r)
            bar.update(1)
        return out
