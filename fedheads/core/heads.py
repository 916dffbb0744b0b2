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


def _uniform(shape: tuple[int, ...], bound: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def _init_linear(din: int, dout: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.nn.Linear default: kaiming_uniform(a=sqrt(5)) == U(+-1/sqrt(fan_in)) for W and b.
    bound = 1.0 / math.sqrt(din)
    return _uniform((din, dout), bound, gen), _uniform((dout,), bound, gen)


def init_head(spec: HeadSpec, seeds: list[int], device: torch.device | str = "cpu") -> tuple[Params, Params]:
    """(params, buffers), one independent initialisation per seed (client axis = len(seeds)).
    Pass the same seed M times for a shared global initialisation (FedAvg)."""
    per: list[tuple[Params, Params]] = []
    for s in seeds:
        gen = torch.Generator().manual_seed(int(s))
        p: Params = {}
        b: Params = {}
        d = spec.in_dim
        if spec.hidden > 0:
            p["proj.weight"], p["proj.bias"] = _init_linear(d, spec.hidden, gen)
            if spec.batch_norm:
                p["bn.weight"] = torch.ones(spec.hidden)
                p["bn.bias"] = torch.zeros(spec.hidden)
                b["bn.running_mean"] = torch.zeros(spec.hidden)
                b["bn.running_var"] = torch.ones(spec.hidden)
            d = spec.hidden
        if spec.num_classes > 0:
            p["cls.weight"], p["cls.bias"] = _init_linear(d, spec.num_classes, gen)
        per.append((p, b))
    stack = lambda key, i: torch.stack([q[i][key] for q in per]).to(device)  # noqa: E731
    return ({k: stack(k, 0) for k in per[0][0]}, {k: stack(k, 1) for k in per[0][1]})


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
