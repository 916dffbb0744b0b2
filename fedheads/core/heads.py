"""The trainable heads, as functional parameter dicts with a leading client axis.

One spec covers every head used in the papers:
- FedPCL projection (Table 7 of the NeurIPS paper): FC(K*d, 256) -> ReLU -> BN(256) -> L2 = z
- FedProto / FedAvg "MLP": the same projection + classifier FC(256, C) on z
- linear probe ("LP"): FC(d, C) only (hidden=0)
Parameters live in `dict[str, Tensor]` (names like torch's state_dict keys, weights transposed
[M, Din, Dout]); BatchNorm running statistics are buffers, not parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedheads.core import ops

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HeadSpec:
    """Shape of a head."""

    in_dim: int  # input feature dimension (sum of the backbones' dims, FedPCL Eq. 1-2)
    hidden: int = 256  # projection width; 0 = no projection (a linear classifier on x)
    num_classes: int = 0  # classifier outputs; 0 = no classifier (FedPCL uses prototypes only)
    batch_norm: bool = True  # BN(hidden) after the ReLU (FedPCL Table 7)
    normalize: bool = True  # L2-normalise the projection output z


def spec_of(params: Params, normalize: bool) -> HeadSpec:
    """The shape of the head whose parameters are `params` (with or without a client axis):
    algorithms read it from their state instead of keeping a per-run spec on `self`."""
    if "proj.weight" in params:
        in_dim, hidden = int(params["proj.weight"].shape[-2]), int(params["proj.weight"].shape[-1])
    else:
        in_dim, hidden = int(params["cls.weight"].shape[-2]), 0
    classes = int(params["cls.weight"].shape[-1]) if "cls.weight" in params else 0
    return HeadSpec(in_dim, hidden, classes, batch_norm="bn.weight" in params, normalize=normalize)


def client_seeds(spec: Any, seed: int) -> list[int]:
    """One initialisation seed per client of `spec` (a DataSpec), from the run seed and the
    client's global id: a client starts from the same head whatever its place in the stack
    (core/order.py)."""
    return [seed * 100_003 + i for i in spec.ids()]


def init_head(spec: HeadSpec, seeds: list[int], device: torch.device | str = "cpu") -> tuple[Params, Params]:
    """(params, buffers), one independent initialisation per seed (client axis = len(seeds)).
    Pass the same seed M times for a shared global initialisation (FedAvg). Each client's rows
    are drawn in place into the stacked tensors (no per-client tensors, no stacking copy)."""
    M = len(seeds)
    shapes: list[tuple[str, tuple[int, ...], float]] = []  # (name, shape, U bound), in draw order
    d = spec.in_dim
    if spec.hidden > 0:
        b = 1.0 / math.sqrt(d)  # torch.nn.Linear default: kaiming_uniform(a=sqrt(5)) == U(+-1/sqrt(fan_in))
        shapes += [("proj.weight", (d, spec.hidden), b), ("proj.bias", (spec.hidden,), b)]
        d = spec.hidden
    if spec.num_classes > 0:
        b = 1.0 / math.sqrt(d)
        shapes += [("cls.weight", (d, spec.num_classes), b), ("cls.bias", (spec.num_classes,), b)]
    p: Params = {k: torch.empty((M, *shape), dtype=torch.float32) for k, shape, _ in shapes}
    for i, s in enumerate(seeds):
        gen = torch.Generator().manual_seed(int(s))
        for k, _, bound in shapes:
            p[k][i].uniform_(-bound, bound, generator=gen)
    buf: Params = {}
    if spec.hidden > 0 and spec.batch_norm:
        h = spec.hidden
        p["bn.weight"], p["bn.bias"] = torch.ones(M, h), torch.zeros(M, h)
        buf = {"bn.running_mean": torch.zeros(M, h), "bn.running_var": torch.ones(M, h)}
    order = [k for k in ("proj.weight", "proj.bias", "bn.weight", "bn.bias", "cls.weight", "cls.bias") if k in p]
    return {k: p[k].to(device) for k in order}, {k: v.to(device) for k, v in buf.items()}


def embed(spec: HeadSpec, params: Params, buffers: Params, x: torch.Tensor, mask: torch.Tensor,
          train: bool) -> tuple[torch.Tensor, Params]:
    """Projection z [M,B,hidden] (or x itself when hidden=0) and the updated buffers."""
    if spec.hidden == 0:
        return x, buffers
    h = ops.relu(ops.linear(x, params["proj.weight"], params["proj.bias"]))
    new_buf = buffers
    if spec.batch_norm:
        h, rm, rv = ops.batch_norm(h, mask, params["bn.weight"], params["bn.bias"],
                                   buffers["bn.running_mean"], buffers["bn.running_var"], train=train)
        new_buf = {"bn.running_mean": rm, "bn.running_var": rv}
    if spec.normalize:
        h = ops.l2_normalize(h)
    return h, new_buf


PROTO_CHUNK_BYTES = 16 << 20  # one [M, rows, width] temporary of a prototype pass stays under this


@torch.no_grad()
def embedding_class_sums(spec: HeadSpec, params: Params, buffers: Params, x: torch.Tensor, y: torch.Tensor,
                         mask: torch.Tensor, num_classes: int, transform=None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.class_sums(embed(transform(x)), y, mask) in eval mode ([M,C,hidden], [M,C]), over row
    chunks whose [M, rows, width] temporaries stay under PROTO_CHUNK_BYTES: in eval mode every
    row is embedded on its own (BatchNorm uses its running statistics), so the chunks give the
    same prototypes (up to float summation order) without several full-size copies of a bucket's
    projections (a 26-client group of 18,000-row clients: 480 MB each at 256-d)."""
    M, N = x.shape[:2]
    width = max(spec.hidden, x.shape[-1], 1)
    rows = max(256, PROTO_CHUNK_BYTES // max(1, M * width * 4))
    sums = counts = None
    for a in range(0, max(N, 1), rows):
        xs = x[:, a:a + rows]
        z, _ = embed(spec, params, buffers, transform(xs) if transform is not None else xs, mask[:, a:a + rows],
                     train=False)
        s, c = ops.class_sums(z, y[:, a:a + rows], mask[:, a:a + rows], num_classes)
        if sums is None or counts is None:
            sums, counts = s, c
        else:
            sums.add_(s), counts.add_(c)
    assert sums is not None and counts is not None
    return sums, counts


def classify(params: Params, z: torch.Tensor) -> torch.Tensor:
    """Logits [M,B,C] from z."""
    return ops.linear(z, params["cls.weight"], params["cls.bias"])


def count_params(params: Params) -> int:
    """Trainable values PER CLIENT actually held in `params` (leading client axis removed)."""
    return sum(t[0].numel() for t in params.values())


def init_global(spec: HeadSpec, seed: int, device: torch.device | str) -> tuple[Params, Params]:
    """One model without client axis (params, buffers): the global model that every client of a
    FedAvg-style algorithm starts from."""
    gp, gb = init_head(spec, [seed], device)
    return {k: v[0] for k, v in gp.items()}, {k: v[0] for k, v in gb.items()}
