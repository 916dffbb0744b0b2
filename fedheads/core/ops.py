"""Functional head operations with a leading client axis (all clients in one kernel call).

Shapes: x [M, B, Din]; per-client weights W [M, Din, Dout] (transposed w.r.t. torch.nn.Linear
so that `baddbmm` needs no copy); row masks [M, B] bool mark valid (non-padding) rows.
For M=1 every op matches the torch.nn module it replaces (checked in tests/test_core_ops.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_ws = threading.local()  # the open buffer pool and gradient workspace (see below)


@contextlib.contextmanager
def buffer_pool() -> Iterator[dict]:
    """Keep the scratch buffers of every `local_train` inside (the engine opens one per run)
    instead of allocating them anew each round: a fresh [M, Din, Dout] tensor (hundreds of MB at
    80 clients x 1536-d) is page-faulted on every call, because glibc hands blocks above 32 MB
    back to the OS on free; that cost as much as the round's GEMMs. Nested pools share the
    outer one. Buffers live until the outermost pool closes."""
    prev = getattr(_ws, "pool", None)
    _ws.pool = prev if prev is not None else {}
    try:
        yield _ws.pool
    finally:
        _ws.pool = prev


def scratch(name: str, like: torch.Tensor) -> torch.Tensor:
    """An UNINITIALISED contiguous buffer shaped like `like`: the pool's (the same memory for the
    same name/trailing shape/dtype/device: the caller must be done with the previous one) inside
    `buffer_pool`, else a fresh one. The pool keeps one buffer per name and trailing shape, as
    many clients long as the largest call asked for, and hands out its first rows: the size
    buckets of one run (fedheads/core/federation.py) share it instead of each keeping its own."""
    pool = getattr(_ws, "pool", None)
    if pool is None or like.dim() == 0:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return pooled_rows(pool, name, like.shape[0], like)


def pooled_rows(pool: dict, name: object, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The first `rows` rows of `pool`'s UNINITIALISED buffer for `name` and `like`'s trailing
    shape, dtype and device, made (or remade larger) when it has fewer rows."""
    key = (name, tuple(like.shape[1:]), like.dtype, like.device)
    buf = pool.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = pool[key] = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    return buf[:rows]


SCRATCH_KEEP_BYTES = 64 << 20  # release_scratch keeps a pool holding at most this much


def release_scratch() -> None:
    """Empty the open pool (`buffer_pool`) when it holds more than SCRATCH_KEEP_BYTES: its buffers
    are freed once their last user lets go, and the next `scratch` call allocates afresh. For a
    caller whose next work needs less scratch than the last (the engine between the calls of a
    partial round), so that the largest call's buffers are not held beside what comes next; a
    small pool is kept, as re-faulting it in every call would cost more than it holds."""
    pool = getattr(_ws, "pool", None)
    if pool is not None and sum(b.numel() * b.element_size() for b in pool.values()) > SCRATCH_KEEP_BYTES:
        pool.clear()


@contextlib.contextmanager
def grad_workspace() -> Iterator[None]:
    """Inside, `linear` writes each weight's gradient into a scratch buffer reused at every step
    (and, within a `buffer_pool`, every round) instead of a fresh [M, Din, Dout] tensor: on CPU
    the page faults of that allocation cost as much as the GEMM. Only for callers that consume
    the gradient before the next backward (local_train). Call `new_step()` before each forward;
    a weight used twice in one step falls back to autograd. A loss function that itself calls
    autograd.grad (e.g. a MAML inner step) must use that gradient before the step's main
    backward, which overwrites the buffer."""
    prev = getattr(_ws, "used", None), getattr(_ws, "count", None)
    _ws.used, _ws.count = set(), {}
    try:
        yield
    finally:
        _ws.used, _ws.count = prev


def new_step() -> None:
    """Mark the start of a forward/backward inside `grad_workspace`."""
    if getattr(_ws, "used", None) is not None:
        _ws.used, _ws.count = set(), {}


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
    used = getattr(_ws, "used", None)
    if used is not None and weight.requires_grad and torch.is_grad_enabled():
        ptr = weight.data_ptr()
        if ptr not in used:
            used.add(ptr)
            # the n-th distinct weight of this shape in the step gets the n-th buffer
            shape = (tuple(weight.shape), weight.dtype, weight.device)
            n = _ws.count.get(shape, 0)
            _ws.count[shape] = n + 1
            return _LinearWS.apply(x, weight, bias, scratch(f"grad{n}", weight))
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


def _contrast_softmax(z: torch.Tensor, protos: torch.Tensor, avail: torch.Tensor, y: torch.Tensor, tau: float
                      ) -> tuple[torch.Tensor, ...]:
    """The shared forward of the prototype contrasts: (pt [SC,d] | [M,SC,d] the prototypes with 1/tau
    folded in, e [M,B,S,C] = exp(logit - max) over A(y) and 0 elsewhere, den = its sum [M,B,S,1],
    mx the max [M,B,S,1], pos [M,B,S] the positive's logit, ok [M,B,S] positive available and A(y)
    not empty, yi the positive's index [M,B,S,1])."""
    S, C, d = protos.shape[-3:]
    M, B = y.shape
    pt = protos.reshape(*protos.shape[:-3], S * C, d) * (1.0 / tau)
    e = torch.matmul(z, pt.transpose(-1, -2)).view(M, B, S, C)  # logits z.P/tau
    yi = y.view(M, B, 1, 1).expand(M, B, S, 1)
    pos = e.gather(-1, yi).squeeze(-1)  # [M,B,S] logit of the positive
    av = avail.reshape(-1, 1, S, C)  # [M|1,1,S,C]
    av_pos = av.expand(M, B, S, C).gather(-1, yi).squeeze(-1)
    ok = av_pos & (av.sum(-1) - av_pos.to(torch.int64) > 0)  # positive available, A(y) not empty
    e.masked_fill_(~av, float("-inf")).scatter_(-1, yi, float("-inf"))  # keep A(y) only
    mx = e.amax(-1, keepdim=True)
    mx.masked_fill_(mx == float("-inf"), 0.0)  # empty A(y): exp gives 0, never NaN
    e.sub_(mx).exp_()
    return pt, e, e.sum(-1, keepdim=True), mx, pos, ok, yi


class _ProtoContrast(torch.autograd.Function):
    """Forward and backward of `proto_contrast` in a few in-place passes over one [M,B,S,C]
    logit buffer. Written out because autograd's version of the straightforward formula
    (einsum, one-hot, masked_fill, logsumexp, where) keeps ~20 full-size temporaries: at 80
    clients x 80 prototype sets that elementwise traffic cost twice the two GEMMs."""

    @staticmethod
    def forward(ctx, z, protos, avail, y, tau):  # type: ignore[override]
        pt, e, den, mx, pos, ok, yi = _contrast_softmax(z, protos, avail, y, tau)
        lse = (mx + den.log()).squeeze(-1)
        terms = torch.where(ok, lse - pos, torch.zeros_like(pos))
        ctx.save_for_backward(e, den, ok, yi, pt, z)
        ctx.tau, ctx.pshape = tau, protos.shape
        ctx.mark_non_differentiable(ok)
        return terms, ok

    @staticmethod
    @torch.autograd.function.once_differentiable  # its second derivative is not written: an error, not a wrong value
    def backward(ctx, g, _g_ok):  # type: ignore[override]
        e, den, ok, yi, pt, z = ctx.saved_tensors
        M, B, S, C = e.shape
        gok = torch.where(ok, g, torch.zeros_like(g)).unsqueeze(-1)  # d terms: softmax over A(y) minus one-hot(y)
        # in place: e is this backward's own (a second backward through the same graph fails
        # autograd's saved-tensor version check instead of reading the overwritten buffer), so the
        # step holds one [M,B,S,C] buffer, not two
        w = e.mul_(gok / den.clamp_min(torch.finfo(e.dtype).tiny))
        w.scatter_(-1, yi, -gok)  # the positive's softmax weight is 0: its slot takes -g
        w = w.view(M, B, S * C)
        gz = torch.matmul(w, pt) if ctx.needs_input_grad[0] else None
        gp = None
        if ctx.needs_input_grad[1]:
            if pt.dim() == 2:  # shared sets: sum over clients and rows
                gp = w.reshape(M * B, S * C).transpose(0, 1) @ z.reshape(M * B, -1)
            else:
                gp = torch.bmm(w.transpose(1, 2), z)
            gp = gp.mul_(1.0 / ctx.tau).view(ctx.pshape)
        return gz, gp, None, None, None


def proto_contrast(z: torch.Tensor, protos: torch.Tensor, avail: torch.Tensor, y: torch.Tensor,
                   tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample and prototype set: lse_{a in A(y)} (z.P_a/tau) - z.P_y/tau, A(y) = the set's
    available classes other than y; 0 where the positive is unavailable or A(y) is empty.

    z [M,B,d]; protos [S,C,d] (sets shared by all clients) or [M,S,C,d]; avail [S,C] or
    [M,S,C] bool; y [M,B] -> (terms [M,B,S], ok [M,B,S] bool). Differentiable in z and protos."""
    return _ProtoContrast.apply(z, protos, avail, y, tau)


CONTRAST_CHUNK_BYTES = 16 << 20  # proto_contrast_sum: logits of at most this many bytes at a time


class _ProtoContrastSum(torch.autograd.Function):
    """`proto_contrast_sum`: the weighted sum's gradient in z is computed in the forward, set
    chunk by set chunk (the weights are known there and the sum is linear in the terms), so
    neither the full [M,B,S,C] logits nor any [M,B,S] tensor outlives its chunk and backward
    only scales the saved [M,B,d] gradient."""

    @staticmethod
    def forward(ctx, z, protos, avail, y, tau, row_w, set_w):  # type: ignore[override]
        S, C = protos.shape[-3:-1]
        M, B = y.shape
        step = max(1, CONTRAST_CHUNK_BYTES // max(M * B * C * z.element_size(), 1))
        total = z.new_zeros(M)
        gz = torch.zeros_like(z)
        for a in range(0, S, step):
            b = min(S, a + step)
            n = b - a
            pt, e, den, mx, pos, ok, yi = _contrast_softmax(z, protos[..., a:b, :, :], avail[..., a:b, :], y, tau)  # sets [a, b)
            wgt = (row_w.view(M, B, 1) * set_w[a:b].view(1, 1, n)).masked_fill_(~ok, 0.0)  # d sum / d term
            term = torch.where(ok, (mx + den.log()).squeeze(-1) - pos, torch.zeros_like(pos))
            total += (wgt * term).sum((1, 2))
            # d term / d logits: softmax over A(y) minus one-hot(y), times the term's weight
            w = e.mul_(wgt.unsqueeze(-1) / den.clamp_min(torch.finfo(e.dtype).tiny))
            w.scatter_(-1, yi, -wgt.unsqueeze(-1))
            gz += torch.matmul(w.view(M, B, n * C), pt)
            del e, w, pt
        ctx.save_for_backward(gz)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable  # as _ProtoContrast
    def backward(ctx, g):  # type: ignore[override]
        (gz,) = ctx.saved_tensors
        return gz * g.view(-1, 1, 1), None, None, None, None, None, None


def proto_contrast_sum(z: torch.Tensor, protos: torch.Tensor, avail: torch.Tensor, y: torch.Tensor, tau: float,
                       row_w: torch.Tensor, set_w: torch.Tensor) -> torch.Tensor:
    """sum_{b,s} row_w[m,b] * set_w[s] * terms[m,b,s] per client [M], terms = proto_contrast's
    (0 where not ok). z [M,B,d]; protos [S,C,d] or [M,S,C,d]; avail [S,C] or [M,S,C]; row_w
    [M,B]; set_w [S]. Differentiable in z only (protos, avail and the weights are constants: a
    protos that requires grad goes through proto_contrast); memory stays at a few
    CONTRAST_CHUNK_BYTES whatever S (_ProtoContrastSum)."""
    if protos.requires_grad or row_w.requires_grad or set_w.requires_grad:
        terms, _ = proto_contrast(z, protos, avail, y, tau)
        return (terms * row_w.unsqueeze(-1) * set_w.view(1, 1, -1)).sum((1, 2))
    return _ProtoContrastSum.apply(z, protos, avail, y, tau, row_w.to(z.dtype), set_w.to(z.dtype))
