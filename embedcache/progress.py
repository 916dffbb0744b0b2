"""Progress for long commands: a tqdm bar on a terminal, plain lines in a log.

tqdm redraws its bar with carriage returns, which a log file (CI, `nohup`, a pipe) keeps as one
line of hundreds of redraws, and it stays silent between redraws. `bar(...)` takes tqdm's
arguments and returns a tqdm bar when its stream is a terminal, and otherwise a `PlainLines` that
prints one plain line when it starts, then at most one every `interval` seconds as it advances,
and one when it ends. Both are used the same way (update, set_postfix, iteration, `with`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

INTERVAL = 10.0  # seconds between plain lines


def bar(iterable: Iterable[Any] | None = None, *, file: IO[str] | None = None, interval: float = INTERVAL,
        **kw: Any) -> Any:
    """A tqdm bar (a terminal) or PlainLines (anything else); `kw` as tqdm's (desc, total, unit,
    initial, disable, leave, ...): disable=None keeps tqdm's meaning, drawn on a terminal only."""
    stream = file if file is not None else sys.stderr
    terminal = _is_terminal(stream)
    if kw.get("disable") or terminal or ("disable" in kw and kw["disable"] is None):  # None: tqdm's "a terminal only"
        from tqdm.auto import tqdm

        return tqdm(iterable, file=file, **kw)
    return PlainLines(iterable, stream, interval, kw.get("desc") or "", kw.get("total"), kw.get("unit") or "it",
                      int(kw.get("initial") or 0))


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class PlainLines:
    """tqdm's interface, writing plain lines: "DESC: N/TOTAL UNIT (ELAPSED s) KEY=VALUE"."""

    def __init__(self, iterable: Iterable[Any] | None, stream: IO[str], interval: float, desc: str,
                 total: int | None, unit: str, initial: int = 0) -> None:
        self.iterable, self.stream, self.interval = iterable, stream, interval
        self.desc, self.unit, self.n = desc, unit, initial
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)  # type: ignore[arg-type]
        self.postfix = ""  # as tqdm's: "key=value, key=value"
        self.t0 = self.last = time.monotonic()
        self.closed = False
        self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        extra = f" {self.postfix}" if self.postfix else ""
        head = f"{self.desc}: " if self.desc else ""
        self.stream.write(f"{head}{self.n}{of} {self.unit} ({time.monotonic() - self.t0:.0f} s){extra}\n")
        self.stream.flush()
        self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._line()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kw: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kw}.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        """tqdm's redraw: nothing to do between plain lines."""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "PlainLines: no iterable to iterate"
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
