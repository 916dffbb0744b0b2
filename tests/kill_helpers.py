"""kill -9 a real subprocess at a chosen round and run it again: the scaffolding of every resume
test (fine-tuning, FedDRA, head training). Imported, not collected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """This checkout (and tests/, for the doubles) first on the subprocess's path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                          os.environ.get("PYTHONPATH", "")])}


def stop_after(target: str, round_of: str, at: int, delay: float, occurrence: int = 1) -> str:
    """Python source to put before a script: `target` ("module:Class") gets a `save` that prints
    "ROUND <r>" after saving (r = the expression `round_of` over the save's arguments `a`) and
    sleeps `delay` seconds on the `occurrence`-th save of round `at` (where the test kills it)."""
    module, cls = target.split(":")
    return f"""
import importlib as _il, time as _time
_cls = getattr(_il.import_module({module!r}), {cls!r})
_orig, _hits = _cls.save, [0]
def _save(self, *a):
    _orig(self, *a)
    r = {round_of}
    print("ROUND", r, flush=True)
    if r == {at}:
        _hits[0] += 1
        if _hits[0] == {occurrence}:
            _time.sleep({delay})
_cls.save = _save
"""


def run_script(code: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def kill_at(code: str, marker: str, occurrence: int = 1, deadline: float = 900) -> None:
    """Run `code` and kill -9 its process group once it has printed `marker` `occurrence` times.
    Every wait is bounded: a run that has not got there within `deadline` seconds (a loaded machine)
    is killed too, and the test fails saying so, instead of going on from the wrong point."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = 0
    try:
        end = time.monotonic() + deadline
        for line in proc.stdout:  # type: ignore[union-attr]
            seen += line.startswith(marker)
            if seen >= occurrence or time.monotonic() > end:
                break
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
    assert seen >= occurrence, f"{marker!r} printed {seen} of {occurrence} times before the run ended or {deadline:.0f} s passed"
