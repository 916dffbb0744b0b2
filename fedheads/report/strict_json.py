"""Results files are strict JSON: it has no NaN or Infinity, which Python's json writes by default."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def strict(obj: Any) -> Any:
    """`obj` with every non-finite float (a NaN accuracy, an infinite epsilon) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Indented, sorted keys, non-finite numbers as null."""
    return json.dumps(strict(obj), indent=2, sort_keys=True, allow_nan=False)
