"""Functional head operations with a leading client axis (all clients in one kernel call).

Shapes: x [M, B, Din]; per-client weights W [M, Din, Dout] (transposed w.r.t. torch.nn.Linear
so that `baddbmm` needs no copy); row masks [M, B] bool mark valid (non-padding) rows.
For M=1 every op matches the torch.nn module it replaces (checked in tests/test_core_ops.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

_ws = threading.local()  # active gradient workspace of local_train (see grad_workspace)


@contextlib.contextmanager
def grad_workspace() -> Iterator[dict]:
    """Inside, `linear` writes each weight's gradient into a buffer reused at every step instead
    of a fresh [M, Din, Dout] tensor: on CPU the page faults of that allocation cost as much as
    the GEMM. Only for callers that consume the gradient before the next backward (local_train).
    Call `new_step()` before each forward; a weight used twice in one step falls back to autograd.
    A loss function that itself calls autograd.grad (e.g. a MAML inner step) must use that
    gradient before the step's main backward, which overwrites the buffer."""
    prev = getattr(_ws, "bufs", None)
    _ws.bufs, _ws.used = {}, set()
    try:
        yield _ws.bufs
    finally:
        _ws.bufs, _ws.used = prev, set()


def new_step() -> None:
    """Mark the start of a forward/backward inside `grad_workspace`."""
    if getattr(_ws, "bufs", None) is not None:
        _ws.used = set()


class _LinearWS(torch.autograd.Function):
    """baddbmm whose weight gradient lands in a preallocated buffer."""

    @staticmethod
    def forward(ctx, x, w, b, buf):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.buf, ctx.has_b = buf, b is not None
        return torch.bmm(x, w) if b is None else torch.baddbmm(b.unsqueeze(1), x, w)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = torch.bmm(gy, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            # create_graph=True (second-order methods) needs a differentiable, fresh gradient
            gw = torch.bmm(x.transpose(1, 2), gy) if torch.is_grad_enabled() else torch.bmm(x.transpose(1, 2), gy, out=ctx.buf)
        gb = gy.sum(1) if ctx.has_b and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y[m] = x[m] @ W[m] + b[m] for every client m."""
    bufs = getattr(_ws, "bufs", None)
    if bufs is not None and weight.requires_grad and torch.is_grad_enabled():
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
        if key not in _ws.used:
            _ws.used.add(key)
            if key not in bufs:
                bufs[key] = torch.empty_like(weight)
            return _LinearWS.apply(x, weight, bias, bufs[key])
    if bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(bias.unsqueeze(1), x, weight)


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Unit length along the last axis (torch.nn.functional.normalize semantics)."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)


def batch_norm(
    x: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    *,
    train: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNorm1d per client over the valid rows of its batch.

    Train: normalise with the biased batch variance over valid rows and update the running stats
    like torch (running = (1-momentum)*running + momentum*stat, running_var with the UNBIASED
    variance). A client with no valid row keeps its running stats. A single valid row (torch
    raises there) normalises to zero and updates running_var with count/(count-1) clamped to 1.
    Eval: use running stats. Returns (y, new_running_mean, new_running_var)."""
    if not train:
        y = (x - running_mean.unsqueeze(1)) * torch.rsqrt(running_var.unsqueeze(1) + eps)
        return y * weight.unsqueeze(1) + bias.unsqueeze(1), running_mean, running_var
    m = mask.unsqueeze(-1).to(x.dtype)  # [M,B,1]
    cnt = m.sum(1)  # [M,1]
    safe = cnt.clamp_min(1.0)
    mean = (x * m).sum(1) / safe  # [M,D]
    xc = x - mean.unsqueeze(1)
    var = (xc * xc * m).sum(1) / safe
    y = xc * torch.rsqrt(var.unsqueeze(1) + eps) * weight.unsqueeze(1) + bias.unsqueeze(1)
    with torch.no_grad():
        unbiased = var * (cnt / (cnt - 1.0).clamp_min(1.0))
        has = cnt > 0
        new_mean = torch.where(has, (1 - momentum) * running_mean + momentum * mean.detach(), running_mean)
        new_var = torch.where(has, (1 - momentum) * running_var + momentum * unbiased.detach(), running_var)
    return y, new_mean, new_var


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the valid entries of the last axis per client: [M,B] -> [M] (0 if none valid)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def class_sums(z: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-client per-class sums of z and counts over valid rows: ([M,C,D], [M,C])."""
    onehot = F.one_hot(y.clamp_min(0), num_classes).to(z.dtype) * mask.unsqueeze(-1).to(z.dtype)  # [M,N,C]
    return torch.bmm(onehot.transpose(1, 2), z), onehot.sum(1)


def masked_accuracy(scores: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-client accuracy of argmax(scores) over valid rows: [M] (NaN for a client without rows)."""
    hit = (scores.argmax(-1) == y) & mask
    return hit.sum(-1).to(torch.float64) / mask.sum(-1).to(torch.float64)


def masked_cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over each client's valid rows: logits [M,B,C], y [M,B] -> [M]."""
    ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # [M,B]
    return masked_mean(ce, mask)
