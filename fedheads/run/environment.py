"""Where a run ran: the machine facts that results.json and the benchmarks record."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: torch.device | str) -> dict[str, Any]:
    """cpu_count (logical CPUs), usable_cpus (this process's affinity), cpu_model, threads (torch
    intra-op threads), device, gpu (its name on CUDA, else None), torch version."""
    dev = torch.device(device)
    return {"cpu_count": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_model": cpu_model(), "threads": torch.get_num_threads(), "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch": torch.__version__}
