"""Bad user input (`UserError`: the CLIs print it as a single line and exit 2) and reads that
succeeded but deserve a note (`StoreWarning`)."""


from collections.abc import Iterable


class UserError(Exception):
    """Bad input (file, image, backbone, label, shape...). The message names the offending item."""


class StoreWarning(UserWarning):
    """A feature store was read correctly but not as written (e.g. its consolidated metadata was
    stale, or a stale shard was served because it was asked for by name). The CLIs show it as
    one `note: ...` line."""


def unknown_name(name: str, known: Iterable[str], what: str) -> UserError:
    """One line: `name` is not a known `what`, the closest known name, and the known ones."""
    import difflib

    known = sorted(set(known))
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return UserError(f"unknown {what} {name!r}{hint} (known: {', '.join(known)})")
