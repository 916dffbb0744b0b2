"""Data manifests (contract 1 in docs/contracts.md): for every client its domain and its train and
test samples (locator into the source + label), plus the class names, the source, the recipe
and the seed that produced it, and a content hash. The unit of reproducibility: the same
`embedcache partition` command and seed give the same manifest, byte for byte (canonical JSON),
as long as the images are the same files.

Every sample also records a fingerprint of its image at partition time (size and mtime, or a
sha256 of the file; see ImageSource.fingerprint), so that features cached for an image that has
since changed are never served: the fingerprint is part of the sample-list hash, hence of the
shard cache key, and `embedcache extract` re-fingerprints before it trusts a cache hit.

On disk (JSON, or YAML with the same keys):
    {"format": "embedcache-manifest/1", "source": ..., "classes": [...], "seed": 0,
     "recipe": {..., "fingerprint": "stat"}, "report": {...}, "content_hash": "<sha256>",
     "clients": [{"name": "c00-amazon", "domain": "amazon",
                  "train": [[id, locator, label, fingerprint], ...], "test": [...]}]}
A row without fingerprint ([id, locator, label], as written before fingerprints existed) is
read with fingerprint "" and written back the same way, so such manifests keep their hashes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedcache.atomic import write_text
from embedcache.errors import UserError
from embedcache.parsing import loads_json, loads_yaml

FORMAT = "embedcache-manifest/1"
_CLIENT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
SPLITS = ("train", "test")
FINGERPRINT_KINDS = ("stat", "sha256")  # see ImageSource.fingerprint (contract 2)
SUFFIXES = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}


@dataclass(frozen=True)
class Sample:
    id: str  # unique within the manifest and stable
    locator: str  # what ImageSource.load() takes
    label: int  # index into Manifest.classes
    fingerprint: str = ""  # ImageSource.fingerprint(locator, kind) at partition time; "" = not recorded
    text: str | None = None  # the paired text (caption, report) of a vision-language sample

    def row(self) -> list[Any]:
        """The on-disk row; without a fingerprint exactly the old 3-element row (same hashes);
        a paired sample appends its text as a fifth element."""
        base: list[Any] = [self.id, self.locator, int(self.label)]
        if self.text is not None:
            return base + [self.fingerprint, self.text]
        return base + [self.fingerprint] if self.fingerprint else base


@dataclass(frozen=True)
class Client:
    name: str  # unique, filesystem-safe
    domain: str
    train: tuple[Sample, ...]
    test: tuple[Sample, ...]


# Windows device names: a file or directory so named (with any extension) cannot be created there.
_RESERVED = frozenset({"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)),
                       *(f"LPT{i}" for i in range(1, 10))})


def client_name_problem(name: Any) -> str | None:
    """Why `name` cannot be a client name (None: it can). A client name is a directory of the
    store on every file system: [A-Za-z0-9_.-]+, not starting or ending with '.' ('.' and '..'
    are directories already, a leading '.' is hidden and the store's own temporary names start
    with one, Windows drops a trailing one), and not a Windows device name (CON, NUL, COM1...)."""
    if not isinstance(name, str) or not _CLIENT_NAME.match(name):
        return "must match [A-Za-z0-9_.-]+"
    if name.startswith(".") or name.endswith("."):
        return "must not start or end with '.'"
    if name.split(".")[0].upper() in _RESERVED:
        return "is a reserved device name on Windows (CON, PRN, AUX, NUL, COM1-9, LPT1-9)"
    return None


def check_client_name(name: Any, where: str = "") -> None:
    """UserError naming the client name when client_name_problem finds one."""
    why = client_name_problem(name)
    if why is not None:
        raise UserError(f"{where + ': ' if where else ''}client name {name!r} {why}")


def check_domain(domain: Any, where: str = "") -> None:
    """A domain is a one-line string: it is printed in messages, reports and tables."""
    if not isinstance(domain, str) or any(ord(ch) < 32 or ord(ch) == 127 for ch in domain):
        raise UserError(f"{where + ': ' if where else ''}domain {domain!r} must be text without control characters "
                        "(tabs, line breaks)")


def locator_problem(locator: str) -> str | None:
    """Why `locator` does not name a file inside its source (None: it does). Locators are
    relative paths: an absolute one or one with '..' would read (and cache) files outside it."""
    if not locator:
        return "is empty"
    if locator.startswith("/") or ".." in locator.split("/"):
        return "points outside the source (locators are relative paths without '..')"
    return None


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class Manifest:
    source: str
    classes: tuple[str, ...]
    clients: tuple[Client, ...]
    recipe: dict = field(default_factory=dict)
    seed: int = 0
    report: dict = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        """Everything but the hash, as plain JSON values."""
        return {
            "format": FORMAT, "source": self.source, "classes": list(self.classes), "seed": int(self.seed),
            "recipe": self.recipe, "report": self.report,
            "clients": [{"name": c.name, "domain": c.domain,
                         "train": [s.row() for s in c.train],
                         "test": [s.row() for s in c.test]} for c in self.clients],
        }

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.body()).encode()).hexdigest()

    @property
    def fingerprint_kind(self) -> str:
        """How the samples' fingerprints were taken ("stat" unless the recipe says otherwise)."""
        return str(self.recipe.get("fingerprint") or "stat")

    @property
    def paired(self) -> bool:
        """Every sample carries a text (a vision-language manifest)."""
        samples = self.all_samples()
        return bool(samples) and all(s.text is not None for s in samples)

    def all_samples(self) -> list[Sample]:
        return [s for c in self.clients for split in SPLITS for s in getattr(c, split)]

    def client(self, name: str) -> Client:
        for c in self.clients:
            if c.name == name:
                return c
        raise UserError(f"client {name!r}: not in the manifest")

    def samples(self, client: str, split: str) -> tuple[Sample, ...]:
        if split not in SPLITS:
            raise UserError(f"split {split!r}: must be train or test")
        return getattr(self.client(client), split)

    def sample_list_hash(self, client: str, split: str) -> str:
        """sha256 over the source and the (id, locator, label[, fingerprint]) rows of one split:
        the part of the cache key that changes whenever the samples of a shard, or their images
        as recorded by the fingerprints, change."""
        rows = [s.row() for s in self.samples(client, split)]
        return hashlib.sha256(canonical_json([self.source, rows]).encode()).hexdigest()

    def validate(self, where: str = "manifest") -> Manifest:
        """UserError naming the offending item: bad client names (also names equal but for
        case: they would share one directory on a case-insensitive file system), duplicate ids,
        labels outside the class list, duplicate class names, an unknown fingerprint kind."""
        if len(set(self.classes)) != len(self.classes):
            raise UserError(f"{where}: duplicate class names")
        if self.fingerprint_kind not in FINGERPRINT_KINDS:
            raise UserError(f"{where}: recipe.fingerprint {self.fingerprint_kind!r} must be one of "
                            f"{', '.join(FINGERPRINT_KINDS)}")
        seen_clients: dict[str, str] = {}
        seen_ids: set[str] = set()
        for c in self.clients:
            check_client_name(c.name, where)
            check_domain(c.domain, f"{where}: client {c.name}")
            other = seen_clients.get(c.name.casefold())
            if other == c.name:
                raise UserError(f"{where}: client {c.name} appears twice")
            if other is not None:
                raise UserError(f"{where}: client names {other!r} and {c.name!r} differ only in case "
                                f"(they would share one directory on a case-insensitive file system)")
            seen_clients[c.name.casefold()] = c.name
            for split in SPLITS:
                for s in getattr(c, split):
                    if not 0 <= s.label < len(self.classes):
                        raise UserError(f"{where}: sample {s.id} ({c.name}/{split}) has label {s.label} "
                                        f"outside the class list 0..{len(self.classes) - 1}")
                    bad = locator_problem(s.locator)
                    if bad is not None:
                        raise UserError(f"{where}: sample {s.id} ({c.name}/{split}) has locator {s.locator!r}, which {bad}")
                    if s.id in seen_ids:
                        raise UserError(f"{where}: sample id {s.id} appears twice")
                    seen_ids.add(s.id)
        return self


def manifest_to_json(m: Manifest) -> str:
    body = m.body()
    body["content_hash"] = m.content_hash
    return json.dumps(body, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def manifest_to_yaml(m: Manifest) -> str:
    """The same keys as the JSON form; deterministic (sorted keys, one flow-style row per sample)."""
    import yaml

    body = m.body()
    body["content_hash"] = m.content_hash
    return yaml.safe_dump(body, sort_keys=True, default_flow_style=None, allow_unicode=False, width=4096)


def _format(path: Path) -> str:
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"{path}: manifest files end in .json, .yaml or .yml (got {path.suffix or 'no suffix'!r})")
    return fmt


def save_manifest(m: Manifest, path: str | Path) -> None:
    """JSON (.json, canonical) or YAML (.yaml/.yml), chosen by the suffix; written atomically
    (temp file + rename). Any other suffix is refused before anything is written."""
    path = Path(path)
    fmt = _format(path)
    m.validate(str(path))
    text = manifest_to_yaml(m) if fmt == "YAML" else manifest_to_json(m)
    write_text(path, text)


def _samples(rows: Any, where: str) -> tuple[Sample, ...]:
    out = []
    for r in rows:
        if not isinstance(r, (list, tuple)) or len(r) not in (3, 4, 5):
            raise UserError(f"{where}: sample rows must be [id, locator, label], [id, locator, label, "
                            f"fingerprint] or [id, locator, label, fingerprint, text], got {r!r}")
        if len(r) == 5 and not isinstance(r[4], str):
            raise UserError(f"{where}: sample {r[0]!r} has a text that is not a string: {r[4]!r}")
        if type(r[2]) is not int:  # not int(): 1.9 and true would both read as 1
            raise UserError(f"{where}: sample {r[0]!r} has label {r[2]!r}; labels are integer class indices")
        out.append(Sample(str(r[0]), str(r[1]), r[2], str(r[3]) if len(r) >= 4 else "",
                          r[4] if len(r) == 5 else None))
    return tuple(out)


def manifest_from_dict(d: Any, where: str = "manifest") -> Manifest:
    if not isinstance(d, dict):
        raise UserError(f"{where}: not a manifest (expected a mapping)")
    for key in ("source", "classes", "clients"):
        if key not in d:
            raise UserError(f"{where}: key {key!r} missing")
    try:
        clients = tuple(Client(str(c["name"]), str(c.get("domain", "")),
                               _samples(c.get("train", []), f"{where}: {c['name']}/train"),
                               _samples(c.get("test", []), f"{where}: {c['name']}/test")) for c in d["clients"])
    except (KeyError, TypeError):
        raise UserError(f"{where}: every client needs a name and train/test lists") from None
    m = Manifest(source=str(d["source"]), classes=tuple(str(c) for c in d["classes"]), clients=clients,
                 recipe=dict(d.get("recipe", {})), seed=int(d.get("seed", 0)), report=dict(d.get("report", {})))
    m.validate(where)
    want = d.get("content_hash")
    if want is not None and want != m.content_hash:
        raise UserError(f"{where}: content_hash does not match the content (edited by hand? remove the "
                        f"content_hash key to accept the edit)")
    return m


def load_manifest(path: str | Path) -> Manifest:
    """Read a .json/.yaml manifest, checking its hash, labels and ids (UserError on bad input)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: manifest file not found")
    text = path.read_text()
    fmt = SUFFIXES.get(path.suffix.lower(), "JSON")
    try:
        data = loads_yaml(text, str(path)) if fmt == "YAML" else loads_json(text, str(path))
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{path}: not valid {fmt} ({str(exc).splitlines()[0]})") from None
    return manifest_from_dict(data, str(path))
