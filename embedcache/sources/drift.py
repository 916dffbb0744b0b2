"""Have the images changed since the manifest was written? (contract 2)

The manifest records each sample's fingerprint at partition time; `check_unchanged` takes them
again with the same kind and refuses, in one line naming the changed or missing images, when
any differs. `embedcache extract` runs it before anything else, cache hits included, so features
of an image that has since been overwritten are never served. The default "sha256" kind reads
every file (in threads: hashlib releases the GIL), a small fraction of decoding it; "stat" (opt-in,
and the kind of manifests written before sha256 became the default) costs one stat per image but
misses a same-size replacement whose mtime was kept (`cp -p`, `rsync -t`): such manifests get a
note saying so, and keep working as they are (their kind is in the recipe).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from embedcache.errors import UserError
from embedcache.manifest import FINGERPRINT_KINDS, Manifest

EXAMPLES = 3  # changed images named in the error line
# a "stat" fingerprint as ImageFolder takes it; builtin:digits and jda-digits fingerprint content
# whatever the kind, so their "stat" manifests are as safe as sha256 ones and get no note
_STAT_FP = re.compile(r"\d+:\d+")


@dataclass(frozen=True)
class Change:
    """A sample whose image is not what the manifest recorded."""

    sample_id: str
    locator: str
    recorded: str  # fingerprint in the manifest
    now: str | None  # fingerprint now; None when the image is missing or unreadable
    reason: str = ""  # the source's one-line error when `now` is None

    def describe(self, kind: str) -> str:
        if self.now is None:
            return self.reason or f"{self.locator}: missing"
        if kind == "stat":
            (a, _, ta), (b, _, tb) = self.recorded.partition(":"), self.now.partition(":")
            if a != b:
                return f"{self.locator}: size {a} -> {b}"
            if ta != tb:
                return f"{self.locator}: rewritten (same size, new modification time)"
        if kind == "sha256" and len(self.recorded) == len(self.now) == 64:
            return f"{self.locator}: content changed (sha256 {self.recorded[:8]} -> {self.now[:8]})"
        return f"{self.locator}: content changed"


def _fingerprinter(source: Any, spec: str):
    fp = getattr(source, "fingerprint", None)
    if fp is None:
        raise UserError(f"{spec}: this image source cannot fingerprint samples (contract 2 needs "
                        f"ImageSource.fingerprint)")
    return fp


def fingerprint_all(source: Any, locators: Sequence[str], kind: str, *,
                    workers: int | None = None) -> list[str | UserError]:
    """The fingerprint of every locator, in order; a missing or unreadable sample gives its
    UserError instead of a string (the caller decides whether that is fatal)."""
    if kind not in FINGERPRINT_KINDS:
        raise UserError(f"--fingerprint {kind!r}: must be one of {', '.join(FINGERPRINT_KINDS)}")
    fp = _fingerprinter(source, getattr(source, "spec", type(source).__name__))

    def one(loc: str) -> str | UserError:
        try:
            return fp(loc, kind)
        except UserError as exc:
            return exc
        except OSError as exc:  # unreadable (permissions, I/O error)
            return UserError(f"{loc}: unreadable ({exc.strerror or exc})")

    if kind == "sha256" and len(locators) > 64:
        n = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(n, thread_name_prefix="embedcache-fingerprint") as pool:
            return list(pool.map(one, locators, chunksize=32))
    return [one(loc) for loc in locators]


def find_changes(manifest: Manifest, source: Any = None, *, workers: int | None = None) -> list[Change]:
    """Every sample with a recorded fingerprint whose image now fingerprints differently (or
    is gone), in manifest order. Samples without a fingerprint are not checked."""
    samples = [s for s in manifest.all_samples() if s.fingerprint]
    if not samples:
        return []
    if source is None:
        from embedcache.sources import open_source

        source = open_source(manifest.source)
    now = fingerprint_all(source, [s.locator for s in samples], manifest.fingerprint_kind, workers=workers)
    out = []
    for s, fp in zip(samples, now):
        if isinstance(fp, UserError):
            out.append(Change(s.id, s.locator, s.fingerprint, None, str(fp)))
        elif fp != s.fingerprint:
            out.append(Change(s.id, s.locator, s.fingerprint, fp))
    return out


def check_unchanged(manifest: Manifest, source: Any = None, *, workers: int | None = None) -> list[str]:
    """UserError (one line) when any image changed since the manifest was written; otherwise
    the notes worth telling the user (fingerprints absent, so drift cannot be detected)."""
    samples = manifest.all_samples()
    bare = sum(1 for s in samples if not s.fingerprint)
    notes = []
    if samples and bare == len(samples):
        notes.append("the manifest records no image fingerprints (written before embedcache kept them), so "
                     "images changed since cannot be detected; re-run the same `embedcache partition` command "
                     "to record them")
    elif bare:
        notes.append(f"{bare} of {len(samples)} samples have no fingerprint; changes to their images cannot "
                     f"be detected")
    if manifest.fingerprint_kind == "stat" and any(_STAT_FP.fullmatch(s.fingerprint) for s in samples):
        notes.append("the manifest's image fingerprints are size + modification time (--fingerprint stat), so "
                     "an image replaced by another of the same size with its time kept (cp -p, rsync -t) is "
                     "not seen; re-run its `embedcache partition` command with --fingerprint sha256 to check "
                     "contents")
    changes = find_changes(manifest, source, workers=workers)
    if changes:
        kind = manifest.fingerprint_kind
        shown = ", ".join(c.describe(kind) for c in changes[:EXAMPLES])
        more = ", ..." if len(changes) > EXAMPLES else ""
        n = len(changes)
        raise UserError(f"{n} image{'s' if n != 1 else ''} changed since the manifest was written "
                        f"(e.g. {shown}{more}); re-run the same `embedcache partition` command to record "
                        f"{'them' if n != 1 else 'it'} (features will be re-extracted)")
    return notes
