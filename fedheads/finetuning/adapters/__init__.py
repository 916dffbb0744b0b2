"""Federated LoRA algorithms on the live fine-tuning path, one file each, found by listing this
package (nothing names them): every module defines one subclass of
fedheads.finetuning.adapters.base.AdapterFT with its registry `name` (the `--set adapter=` value).

    base        the shared machinery: adapters on the network, client SGD, sums + finalize, state
    fedit       LoRA under FedAvg (FedIT): A and B averaged separately
    ffa_lora    FFA-LoRA: A frozen at its random initialisation, only B trained and sent
    fedsa_lora  FedSA-LoRA: A shared and averaged, B kept by each client
    flora       FLoRA: the clients' factors stacked, their product merged into the weights
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any

from embedcache.errors import UserError


@cache
def adapter_algorithms() -> dict[str, type]:
    """{name: AdapterFT subclass} of every module of this package."""
    from fedheads.finetuning.adapters.base import AdapterFT

    out: dict[str, type] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name == "base":
            continue
        m = importlib.import_module(f"{__name__}.{mod.name}")
        for obj in vars(m).values():
            if isinstance(obj, type) and issubclass(obj, AdapterFT) and obj is not AdapterFT and obj.__module__ == m.__name__:
                out[obj.name] = obj
    return dict(sorted(out.items()))


def create_adapter_algorithm(name: str, *args: Any, **kw: Any) -> Any:
    algs = adapter_algorithms()
    if name not in algs:
        raise UserError(f"adapter {name!r}: use none or one of {', '.join(algs)}")
    return algs[name](*args, **kw)
