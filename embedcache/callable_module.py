"""Modules that are also the API function of the same name.

`embedcache.extract`, `embedcache.partition` and `fedheads.predict` are both a module (which the
code imports from: `from embedcache.extract import ExtractConfig`, `import embedcache.extraction as
ex`) and the top-level API function users call (`embedcache.extract(manifest, ...)`). A plain
function in the package would be replaced by the module the first time the module is imported
(the import system sets the package attribute), so instead the module itself becomes callable:
calling it calls the API function, and `inspect.signature` shows that function's signature."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any


class _CallableModule(types.ModuleType):
    __api__: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__api__(*args, **kwargs)


def make_callable(module_name: str, api: Callable[..., Any]) -> None:
    """Calling the module `module_name` (already in sys.modules) calls `api`."""
    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module.__api__ = api  # type: ignore[attr-defined]
    module.__signature__ = inspect.signature(api)  # type: ignore[attr-defined]
