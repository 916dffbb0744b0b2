"""The training progress bar: a `Progress` hook of the engine (fedheads.core.engine.run) drawn
with tqdm on a terminal and as plain lines in a log (embedcache.progress), so the engine itself
reports rounds without depending on a terminal library."""

from __future__ import annotations

from typing import IO, Any

from embedcache.progress import bar as tqdm
from fedheads.core.engine import RoundRecord


class RoundBar:
    """One bar per run: created at the engine's first report (which says how many rounds a resumed
    run has already done), advanced after every round, with the mean test accuracy of the last
    evaluated round as its postfix. `enabled=False`: nothing is drawn. Close it (or use `with`)."""

    def __init__(self, desc: str, enabled: bool = True, file: IO[str] | None = None) -> None:
        self.desc, self.enabled, self.file = desc, enabled, file
        self.bar: Any = None

    def __call__(self, done: int, total: int, record: RoundRecord | None) -> None:
        if self.bar is None:
            self.bar = tqdm(desc=self.desc, total=total, initial=done - (record is not None), unit="round",
                            disable=not self.enabled, leave=False, file=self.file)
        if record is not None:
            if record.accuracy is not None:
                self.bar.set_postfix(acc=f"{float(record.accuracy['main'].nanmean()):.3f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> RoundBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
