"""Child processes that die with the process that started them.

Every process fedheads starts (Flower's SuperLink and `flwr run`, a node's `embedcache extract`)
goes through `popen` / `run` here: on Linux the child asks the kernel for SIGTERM when its parent
dies (prctl PR_SET_PDEATHSIG), so a parent killed by SIGKILL, whose own clean-up never runs, does
not leave a SuperLink holding its port. SIGTERM, not SIGKILL: Flower's processes stop their own
children on it. The setting survives execve and is cleared in the child's children, which the
child itself stops. Elsewhere the children are started as usual.

The kernel sends the signal when the THREAD that started the child ends: start long-lived
children from a thread that outlives them (the main thread; `run` blocks its caller anyway)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Any:
    """libc's prctl, looked up once in the parent: between fork and exec a child of a threaded
    process may only make async-signal-safe calls, and dlopen is not one."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


_PRCTL = _load_prctl()


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In the child, between fork and exec: ask for `sig` when the parent thread exits (and
    take it now if the parent `parent` already died before the request was made)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)


def popen(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen whose child gets SIGTERM when this process (thread) dies."""
    return subprocess.Popen(cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()), **kw)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """subprocess.run whose child gets SIGTERM when this process dies."""
    return subprocess.run(cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()), **kw)
