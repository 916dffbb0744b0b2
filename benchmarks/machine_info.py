"""The machine facts every benchmark JSON records, and the environment of a benchmark's child
processes (imported by the sibling scripts)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from fedheads.run.environment import cpu_model, machine

__all__ = ["child_env", "cpu_model", "machine", "machine_facts", "provenance", "write_json"]

REPO = Path(__file__).resolve().parents[1]


def child_env(*extra: str | Path) -> dict[str, str]:
    """os.environ with PYTHONPATH = the repository, benchmarks/, `extra`, then the caller's own
    PYTHONPATH, kept (e.g. an A/B's sitecustomize)."""
    path = [str(REPO), str(REPO / "benchmarks"), *map(str, extra), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def machine_facts() -> dict:
    """cpu_count, cpu_model, torch version, device and torch threads, for a benchmark JSON."""
    import torch

    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__, "device": "cpu",
            "torch_threads": torch.get_num_threads()}


def shown(text: str) -> str:
    """`text` with this user's home directory written as ~ (a cache path in a committed command
    names no machine)."""
    home = str(Path.home())
    if home in ("", os.sep):
        return text
    # only where a path starts (a word, an option's value): /tmp/x/root/... is not the home /root
    return re.sub(r"(?:^|(?<=[\s='\":]))" + re.escape(home + os.sep), lambda _: "~" + os.sep, text)


def provenance() -> dict:
    """The command line that is running and the commit it runs ("+dirty" when the checkout has
    uncommitted changes to tracked files, so a figure is never attributed to code it did not run)."""
    cmd = shown(shlex.join([Path(sys.executable).name, *(
        [os.path.relpath(sys.argv[0], REPO)] if sys.argv and sys.argv[0].endswith(".py") else sys.argv[:1]),
        *sys.argv[1:]]))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"command": cmd, "commit": commit}


def write_json(obj: dict, path: str | Path) -> None:
    """Atomic write (temp name, then os.replace) of a benchmark result; the command and commit that
    made it are added unless the benchmark recorded its own."""
    obj = {**provenance(), **obj}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
