"""The records codec is loss-free for every registered algorithm's client state, server state,
broadcast and message (bit for bit, dtypes and non-tensor leaves included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flower_helpers import FLOWER_MISSING  # noqa: E402

pytest.importorskip("flwr", reason=FLOWER_MISSING)

from fed_tiny import tiny_fed  # noqa: E402

from embedcache.errors import UserError  # noqa: E402
from fedheads.algorithms import create_algorithm, list_algorithms  # noqa: E402
from fedheads.core.protocol import RoundCtx  # noqa: E402
from fedheads.flower import codec  # noqa: E402


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.numpy().tobytes() == b.numpy().tobytes())
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def round_trip(tree):
    arrays, structure = codec.encode(tree)
    return codec.decode(arrays, structure)


@pytest.mark.parametrize("name", [i.name for i in list_algorithms()])
def test_every_algorithm_type_round_trips_bit_exactly(name):
    data = tiny_fed(M=3)
    alg = create_algorithm(name)
    init = alg.init(data.spec(), seed=1)
    cs, ss, bc = init.client_state, init.server_state, init.broadcast
    for r in range(int(getattr(alg, "collect_rounds", 0)) + 2):  # past the collection round: real messages
        ctx = RoundCtx(r, 1, torch.arange(3), 3)
        for tree in (cs, ss, bc):
            assert same(tree, round_trip(tree))
        cs, msg = alg.client_update(cs, bc, data, ctx)
        assert same(msg, round_trip(msg))
        ss, bc = alg.server_aggregate(ss, msg, ctx)
    assert same(ss, round_trip(ss)) and same(cs, round_trip(cs)) and same(bc, round_trip(bc))


def test_scalars_nan_and_containers_survive():
    tree = {"b": True, "i": 2**70, "f": float("nan"), "inf": float("-inf"), "s": "x", "n": None,
            "t": (torch.tensor(True), [torch.zeros(0, 3, dtype=torch.float64), torch.tensor(7)]),
            "h": torch.tensor([1.0, -0.0, 1e-45, float("nan")], dtype=torch.float32)}
    assert same(tree, round_trip(tree))


def test_foreign_types_are_never_resolved():
    arrays, structure = codec.encode(create_algorithm("fedncm").init(tiny_fed(M=2).spec(), 0).broadcast)
    structure["tree"] = str(structure["tree"]).replace("fedheads.algorithms.fedncm", "os")
    with pytest.raises(UserError, match="not a fedheads type"):
        codec.decode(arrays, structure)
