"""Bad user input (`UserError`: the CLIs print it as a single line and exit 2) and reads that
succeeded but deserve a note (`StoreWarning`)."""


from collections.abc import Iterable


class UserError(Exception):
    """Bad input (file, image, backbone, label, shape...). The message names the offending item."""


class StoreWarning(UserWarning):
    """A feature store was read correctly but not as written (e.g. its consolidated metadata was
    stale, or a stale shard was served because it was asked for by name). The CLIs show it as
    one `note: ...` line."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"; did you mean X?" with the known name nearest to `name`, or "" when none is near."""
    import difflib

    near = difflib.get_close_matches(name, sorted(set(known)), n=1)
    return f"; did you mean {near[0]}?" if near else ""


def unknown_name(name: str, known: Iterable[str], what: str) -> UserError:
    """One line: `name` is not a known `what`, the closest known name, and the known ones."""
    known = sorted(set(known))
    return UserError(f"unknown {what} {name!r}{did_you_mean(name, known)} (known: {', '.join(known)})")
