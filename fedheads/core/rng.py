"""Counter-based random numbers: a value is a pure function of integer coordinates
(seed, round, client global index, epoch, row ...), so the vectorised engine (all clients at
once) and the per-client loop draw exactly the same numbers without sharing generator state.

The mixing function is the 32-bit "lowbias"-style integer hash (x ^= x>>16; x *= 0x45d9f3b)
applied in int64 with products kept below 2**63, so it is exact and device independent."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def hash_keys(*coords: torch.Tensor | int) -> torch.Tensor:
    """Hash broadcastable integer coordinates into uint32 values held in int64."""
    h: torch.Tensor | None = None
    for i, c in enumerate(coords):
        c = torch.as_tensor(c, dtype=torch.int64) if not isinstance(c, torch.Tensor) else c.to(torch.int64)
        if h is None:
            h = _mix(c + 0x9E3779B9)
        else:
            h = _mix(h.to(c.device) ^ _mix(c + 0x9E3779B9 * (i + 1)))
    assert h is not None
    return h


def uniform(*coords: torch.Tensor | int) -> torch.Tensor:
    """U(0,1) float64 strictly inside (0,1), one value per broadcast coordinate."""
    return (hash_keys(*coords).to(torch.float64) + 0.5) / 4294967296.0


def normal(*coords: torch.Tensor | int) -> torch.Tensor:
    """Standard normal via Box-Muller from two independent uniforms."""
    u1 = uniform(*coords, 1)
    u2 = uniform(*coords, 2)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)


def laplace(*coords: torch.Tensor | int) -> torch.Tensor:
    """Laplace(0, 1) by inverse CDF."""
    u = uniform(*coords, 3) - 0.5
    return -torch.sign(u) * torch.log1p(-2.0 * u.abs())
