"""Functional ops, optimisers and batch schedules against torch references (M=1) and by hand."""

from __future__ import annotations

import pytest
import torch

from fedheads.core import ops, rng
from fedheads.core.batching import make_schedule
from fedheads.core.heads import HeadSpec, embed, init_head
from fedheads.core.optim import OptimizerConfig, opt_init, opt_step


def test_linear_relu_l2_match_torch() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    x = torch.randn(7, 5)
    y = ops.l2_normalize(ops.relu(ops.linear(x[None], lin.weight.T[None].contiguous(), lin.bias[None])))[0]
    ref = torch.nn.functional.normalize(torch.relu(lin(x)), dim=-1)
    torch.testing.assert_close(y, ref)


def test_batch_norm_matches_torch_train_and_eval_with_padding() -> None:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(6, 4) * 3 + 1
    # padded with 2 garbage rows that the mask must ignore
    xp = torch.cat([x, torch.full((2, 4), 1e3)])[None]
    mask = torch.tensor([[True] * 6 + [False] * 2])
    rm, rv = bn.running_mean.clone()[None], bn.running_var.clone()[None]
    for _ in range(2):
        bn.train()
        ref = bn(x)
        y, rm, rv = ops.batch_norm(xp, mask, bn.weight[None], bn.bias[None], rm, rv, train=True)
        torch.testing.assert_close(y[0, :6], ref)
        torch.testing.assert_close(rm[0], bn.running_mean)
        torch.testing.assert_close(rv[0], bn.running_var)  # unbiased running var like torch
    bn.eval()
    y, _, _ = ops.batch_norm(xp, mask, bn.weight[None], bn.bias[None], rm, rv, train=False)
    torch.testing.assert_close(y[0, :6], bn(x))


def test_batch_norm_client_without_rows_keeps_stats() -> None:
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    rm, rv = torch.zeros(2, 4), torch.ones(2, 4)
    y, nm, nv = ops.batch_norm(x, mask, torch.ones(2, 4), torch.zeros(2, 4), rm, rv, train=True)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(nm[1], rm[1])
    torch.testing.assert_close(nv[1], rv[1])
    assert not torch.equal(nm[0], rm[0])


def test_head_matches_torch_sequential() -> None:
    spec = HeadSpec(in_dim=6, hidden=5, num_classes=0)
    p, b = init_head(spec, [3])
    seq = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.BatchNorm1d(5))
    with torch.no_grad():
        seq[0].weight.copy_(p["proj.weight"][0].T)
        seq[0].bias.copy_(p["proj.bias"][0])
    x = torch.randn(9, 6)
    z, nb = embed(spec, p, b, x[None], torch.ones(1, 9, dtype=torch.bool), train=True)
    torch.testing.assert_close(z[0], torch.nn.functional.normalize(seq(x), dim=-1))
    torch.testing.assert_close(nb["bn.running_var"][0], seq[2].running_var)


def _torch_vs_functional(cfg: OptimizerConfig, make_opt) -> None:
    torch.manual_seed(1)
    w = torch.randn(4, 3, requires_grad=True)
    opt = make_opt([w])
    params = {"w": w.detach().clone()[None]}
    state = opt_init(cfg, params)
    for step in range(5):
        g = torch.randn(4, 3)
        w.grad = g.clone()
        opt.step()
        params, state = opt_step(cfg, params, {"w": g[None]}, state, torch.tensor([True]),
                                 rows=torch.tensor([0]) if step % 2 else None)
        torch.testing.assert_close(params["w"][0], w.detach(), rtol=1e-5, atol=1e-6)


def test_adam_matches_torch() -> None:
    cfg = OptimizerConfig("adam", lr=1e-2, weight_decay=1e-2)
    _torch_vs_functional(cfg, lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2))


def test_sgd_momentum_matches_torch() -> None:
    cfg = OptimizerConfig("sgd", lr=0.1, weight_decay=1e-3, momentum=0.9)
    _torch_vs_functional(cfg, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-3, momentum=0.9))


def test_inactive_client_is_untouched() -> None:
    cfg = OptimizerConfig("adam", lr=0.1)
    params = {"w": torch.randn(2, 3)}
    state = opt_init(cfg, params)
    act = torch.tensor([True, False])
    new, st = opt_step(cfg, params, {"w": torch.ones(2, 3)}, state, act)
    torch.testing.assert_close(new["w"][1], params["w"][1])
    assert not torch.equal(new["w"][0], params["w"][0])
    assert st.step.tolist() == [1.0, 0.0]
    assert float(st.m["w"][1].abs().sum()) == 0.0 and float(st.v["w"][1].abs().sum()) == 0.0
    # the row-indexed path (used by local_train) gives the same result
    new_r, st_r = opt_step(cfg, params, {"w": torch.ones(2, 3)}, state, act, rows=torch.tensor([0]))
    torch.testing.assert_close(new_r["w"], new["w"])
    torch.testing.assert_close(st_r.v["w"], st.v["w"])
    both, _ = opt_step(cfg, params, {"w": torch.ones(2, 3)}, state, torch.tensor([True, True]), rows=torch.tensor([0, 1]))
    torch.testing.assert_close(both["w"][0], new["w"][0])


def test_schedule_covers_each_epoch_once_and_ignores_neighbours() -> None:
    n = [5, 12, 1]
    sched = make_schedule(n, torch.tensor([7, 3, 9]), batch_size=4, epochs=2, seed=1, round_=2)
    assert sched.num_steps == 2 * 3
    for i, ni in enumerate(n):
        spe = -(-ni // 4)
        assert sched.active[:, i].sum() == 2 * spe
        for e in range(2):
            rows = sched.index[e * spe:(e + 1) * spe, i][sched.valid[e * spe:(e + 1) * spe, i]]
            assert sorted(rows.tolist()) == list(range(ni))  # a permutation: no row lost (no drop_last)
    alone = make_schedule([12], torch.tensor([3]), batch_size=4, epochs=2, seed=1, round_=2)
    assert torch.equal(alone.index[:, 0], sched.index[:, 1])  # same batches with M=1 (loop engine)
    other = make_schedule([12], torch.tensor([3]), batch_size=4, epochs=2, seed=1, round_=3)
    assert not torch.equal(other.index, alone.index)


def test_rng_is_deterministic_and_roughly_uniform() -> None:
    u = rng.uniform(5, torch.arange(20000))
    assert torch.equal(u, rng.uniform(5, torch.arange(20000)))
    assert 0.49 < float(u.mean()) < 0.51 and float(u.min()) > 0 and float(u.max()) < 1
    g = rng.normal(1, torch.arange(20000))
    assert abs(float(g.mean())) < 0.03 and abs(float(g.std()) - 1) < 0.03
    lap = rng.laplace(2, torch.arange(20000))
    assert abs(float(lap.abs().mean()) - 1.0) < 0.05  # E|Laplace(0,1)| = 1


def test_inplace_step_equals_functional_step() -> None:
    from fedheads.core.optim import OptState, opt_step_

    for cfg in (OptimizerConfig("adam", lr=0.1, weight_decay=0.01), OptimizerConfig("sgd", lr=0.1, momentum=0.9)):
        torch.manual_seed(0)
        params = {"w": torch.randn(3, 4, 2), "b": torch.randn(3, 2)}
        state = opt_init(cfg, params)
        for rows in (torch.tensor([0, 1, 2]), torch.tensor([0, 2])):
            grads = {k: torch.randn_like(v) for k, v in params.items()}
            active = torch.zeros(3, dtype=torch.bool).index_fill_(0, rows, True)
            want_p, want_s = opt_step(cfg, params, grads, state, active)
            own_p = {k: v.clone() for k, v in params.items()}
            own_s = OptState(state.step.clone(), {k: v.clone() for k, v in state.m.items()},
                             {k: v.clone() for k, v in state.v.items()})
            got_s = opt_step_(cfg, own_p, {k: v.clone() for k, v in grads.items()}, own_s, active)
            for k in params:
                torch.testing.assert_close(own_p[k], want_p[k])
                if len(rows) < 3:  # inactive client untouched bit for bit
                    assert torch.equal(own_p[k][1], params[k][1])
                if k in want_s.m:
                    torch.testing.assert_close(got_s.m[k], want_s.m[k])
            torch.testing.assert_close(got_s.step, want_s.step)
            params, state = want_p, want_s


def test_grad_workspace_linear_matches_autograd_and_second_order() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, requires_grad=True)
    w = torch.randn(2, 3, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    ref = torch.autograd.grad((ops.linear(x, w, b) ** 2).sum(), [x, w, b])
    with ops.grad_workspace():
        for _ in range(2):  # the buffer is reused across steps
            ops.new_step()
            got = torch.autograd.grad((ops.linear(x, w, b) ** 2).sum(), [x, w, b])
            for r, g in zip(ref, got):
                torch.testing.assert_close(g, r)
        ops.new_step()
        y = ops.linear(x, w, b) + ops.linear(x, w, None)  # second use of w falls back
        torch.testing.assert_close(torch.autograd.grad(y.sum(), w)[0], 2 * torch.autograd.grad(ops.linear(x, w, b).sum(), w)[0])
        ops.new_step()
        (gw,) = torch.autograd.grad((ops.linear(x, w, b) ** 2).sum(), [w], create_graph=True)
        (hw,) = torch.autograd.grad(gw.sum(), [w])  # second order still works
        assert torch.isfinite(hw).all()


def _contrast_reference(z, protos, avail, y, tau):
    """The straightforward formula: einsum logits, one-hot positive, logsumexp over A(y)."""
    shared = protos.dim() == 3
    logits = torch.einsum("mbd,scd->mbsc" if shared else "mbd,mscd->mbsc", z, protos) / tau
    is_y = torch.nn.functional.one_hot(y, protos.shape[-2]).bool().unsqueeze(2)
    av = avail.view(1, 1, *avail.shape) if shared else avail.unsqueeze(1)
    pos = (logits * is_y).sum(-1)
    neg = av & ~is_y
    lse = torch.logsumexp(logits.masked_fill(~neg, -1e9), dim=-1)
    ok = (av & is_y).any(-1) & neg.any(-1)
    return torch.where(ok, lse - pos, torch.zeros_like(pos)), ok


def test_proto_contrast_matches_straightforward_formula_and_gradients() -> None:
    torch.manual_seed(0)
    M, B, S, C, d = 3, 5, 4, 6, 7
    y = torch.randint(0, C, (M, B))
    for shared in (True, False):
        shape = (S, C) if shared else (M, S, C)
        avail = torch.rand(shape) > 0.3
        # edge cases: a set whose only available class is the positive's (A(y) empty), a set
        # lacking the positive, and a set with nothing available at all
        if shared:
            avail[0] = False
            avail[0, y[0, 0]] = True
            avail[1, y[0, 1]] = False
            avail[2] = False
        z = torch.randn(M, B, d, dtype=torch.float64, requires_grad=True)
        protos = torch.randn(*shape, d, dtype=torch.float64, requires_grad=True)
        got, ok = ops.proto_contrast(z, protos, avail, y, 0.3)
        want, ok_ref = _contrast_reference(z, protos, avail, y, 0.3)
        assert torch.equal(ok, ok_ref) and bool(ok.any()) and not bool(ok.all())
        torch.testing.assert_close(got, want)
        gw = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad((got * gw).sum(), [z, protos]),
                                   torch.autograd.grad((want * gw).sum(), [z, protos]))
        # the backward reuses its saved logit buffer in place: a second backward through the same
        # graph must fail loudly, never read the overwritten buffer
        got, _ = ops.proto_contrast(z, protos, avail, y, 0.3)
        loss = (got * gw).sum()
        torch.autograd.grad(loss, [z, protos], retain_graph=True)
        with pytest.raises(RuntimeError, match="inplace"):
            torch.autograd.grad(loss, [z, protos])


@pytest.mark.parametrize("chunk_sets", [1, 3, 100])
def test_weighted_contrast_sum_matches_the_weighted_terms(monkeypatch, chunk_sets) -> None:
    """proto_contrast_sum (gradient made in the forward, sets in chunks) equals the weighted sum of
    the reference terms, value and gradient in z, for shared and per-client sets, whatever the
    chunking; with a protos that needs a gradient it takes the general path."""
    torch.manual_seed(1)
    M, B, S, C, d = 3, 5, 7, 6, 4
    y = torch.randint(0, C, (M, B))
    monkeypatch.setattr(ops, "CONTRAST_CHUNK_BYTES", chunk_sets * M * B * C * 8)
    for shared in (True, False):
        shape = (S, C) if shared else (M, S, C)
        avail = torch.rand(shape) > 0.3
        if shared:  # A(y) empty for one row, the positive missing, a set with nothing
            avail[0] = False
            avail[0, y[0, 0]] = True
            avail[1, y[0, 1]] = False
            avail[2] = False
        z = torch.randn(M, B, d, dtype=torch.float64, requires_grad=True)
        protos = torch.randn(*shape, d, dtype=torch.float64)
        mask = torch.rand(M, B) > 0.3
        row_w = mask.double() / mask.sum(-1, keepdim=True).clamp_min(1)
        set_w = (torch.rand(S) > 0.2).double() / 5
        got = ops.proto_contrast_sum(z, protos, avail, y, 0.3, row_w, set_w)
        terms, _ = _contrast_reference(z, protos, avail, y, 0.3)
        want = (terms * row_w.unsqueeze(-1) * set_w.view(1, 1, -1)).sum((1, 2))
        torch.testing.assert_close(got, want)
        gw = torch.randn(M, dtype=torch.float64)
        torch.testing.assert_close(torch.autograd.grad((got * gw).sum(), z)[0],
                                   torch.autograd.grad((want * gw).sum(), z)[0])
        # no second derivative is written: asking for one is an error, not a silently wrong value
        g1 = torch.autograd.grad(ops.proto_contrast_sum(z, protos, avail, y, 0.3, row_w, set_w).sum(), z, create_graph=True)[0]
        with pytest.raises(RuntimeError):
            torch.autograd.grad(g1.sum(), z)
        p2 = protos.clone().requires_grad_(True)
        got2 = ops.proto_contrast_sum(z, p2, avail, y, 0.3, row_w, set_w)
        torch.testing.assert_close(got2, want)
        assert torch.autograd.grad(got2.sum(), p2)[0].abs().sum() > 0


def test_fused_inplace_optimizer_matches_functional_with_diverged_step_counts() -> None:
    from fedheads.core.optim import InPlaceOptimizer, OptState

    # clients whose Adam step counts differ (a persistent optimiser under partial participation)
    # are passed to the fused kernel as separate slices; inactive ones are not touched at all
    for cfg in (OptimizerConfig("adam", lr=0.1, weight_decay=0.01), OptimizerConfig("sgd", lr=0.1, momentum=0.9),
                OptimizerConfig("sgd", lr=0.1, weight_decay=0.1)):
        torch.manual_seed(0)
        params = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 2)}
        state = opt_init(cfg, params)
        state = OptState(torch.tensor([0.0, 3.0, 3.0, 1.0], dtype=torch.float64), state.m, state.v)
        own = {k: v.clone() for k, v in params.items()}
        opt = InPlaceOptimizer(cfg, own, OptState(state.step, {k: v.clone() for k, v in state.m.items()},
                                                  {k: v.clone() for k, v in state.v.items()}))
        for ids in ([0, 1, 2, 3], [1, 2], [0, 3], [0, 1, 2, 3]):
            active = torch.zeros(4, dtype=torch.bool)
            active[ids] = True
            grads = {k: torch.randn_like(v) for k, v in params.items()}
            before = {k: v.clone() for k, v in own.items()}
            params, state = opt_step(cfg, params, grads, state, active)
            opt.step({k: v.clone() for k, v in grads.items()}, active, ids)
            for k in params:
                torch.testing.assert_close(own[k], params[k])
                for i in set(range(4)) - set(ids):
                    assert torch.equal(own[k][i], before[k][i])
        assert torch.equal(opt.state().step, state.step)


def test_local_train_without_kept_optimizer_returns_only_the_counter() -> None:
    from fed_tiny import tiny_fed

    from fedheads.core.protocol import RoundCtx
    from fedheads.core.train import local_train

    data = tiny_fed()
    M = data.num_clients
    params = {"w": torch.zeros(M, data.dim, 3), "b": torch.zeros(M, 3)}

    def loss_fn(p, b, x, y, m):
        return ops.masked_cross_entropy(ops.linear(x, p["w"], p["b"]), y.clamp_max(2), m), b

    ctx = RoundCtx(round=0, seed=0, participants=torch.arange(M), num_clients=M)
    cfg = OptimizerConfig("adam", lr=0.01)
    kept = local_train(params, {}, None, cfg, loss_fn, data, ctx, 4, 1)
    with ops.buffer_pool():
        for _ in range(2):  # pooled moments are zeroed again for the second call
            p, _, opt = local_train(params, {}, None, cfg, loss_fn, data, ctx, 4, 1, keep_opt=False)
            for k in params:
                torch.testing.assert_close(p[k], kept[0][k])
    assert opt.m == {} and opt.v == {} and torch.equal(opt.step, kept[2].step)
    assert not torch.equal(kept[0]["w"], params["w"])  # the caller's params are not modified
    assert float(params["w"].abs().sum()) == 0.0


def test_init_head_rows_are_independent_seeded_draws_in_torch_linear_order() -> None:
    spec = HeadSpec(5, 3, 2)
    p, b = init_head(spec, [4, 9])
    for i, seed in enumerate([4, 9]):
        gen = torch.Generator().manual_seed(seed)
        want = [torch.empty(5, 3).uniform_(-5 ** -0.5, 5 ** -0.5, generator=gen),
                torch.empty(3).uniform_(-5 ** -0.5, 5 ** -0.5, generator=gen),
                torch.empty(3, 2).uniform_(-3 ** -0.5, 3 ** -0.5, generator=gen),
                torch.empty(2).uniform_(-3 ** -0.5, 3 ** -0.5, generator=gen)]
        for k, w in zip(("proj.weight", "proj.bias", "cls.weight", "cls.bias"), want):
            assert torch.equal(p[k][i], w), k
    assert list(p) == ["proj.weight", "proj.bias", "bn.weight", "bn.bias", "cls.weight", "cls.bias"]
    assert torch.equal(b["bn.running_var"], torch.ones(2, 3))


def test_prototype_pass_in_row_chunks_equals_one_pass(monkeypatch):
    """heads.embedding_class_sums: the Eq. 5 prototype pass (FedPCL, FedProto) in row chunks gives
    the sums of one full-size pass (eval-mode rows are independent), padded rows left out."""
    from fedheads.core import heads

    g = torch.Generator().manual_seed(0)
    M, N, D, C = 3, 1000, 12, 5
    spec = HeadSpec(D, 8, 0, batch_norm=True, normalize=True)
    p, b = init_head(spec, [1, 2, 3])
    b = {"bn.running_mean": torch.randn(M, 8, generator=g), "bn.running_var": torch.rand(M, 8, generator=g) + 0.5}
    x, y = torch.randn(M, N, D, generator=g), torch.randint(0, C, (M, N), generator=g)
    mask = torch.arange(N).expand(M, N) < torch.tensor([[1000], [613], [0]])
    for transform in (None, torch.sign):
        z, _ = embed(spec, p, b, x if transform is None else transform(x), mask, train=False)
        want = ops.class_sums(z, y, mask, C)
        monkeypatch.setattr(heads, "PROTO_CHUNK_BYTES", 1)  # 256-row chunks: 4 of them
        got = heads.embedding_class_sums(spec, p, b, x, y, mask, C, transform)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1]) and got[1][2].sum() == 0
        monkeypatch.undo()
    empty = heads.embedding_class_sums(spec, p, b, x[:, :0], y[:, :0], mask[:, :0], C)
    assert empty[0].shape == (M, C, 8) and empty[0].abs().sum() == 0


@pytest.mark.parametrize("presorted", [False, True])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_rowwise_local_train_computes_only_stepping_clients_and_changes_nothing(opt_name, presorted) -> None:
    """rowwise=True: each step computes only the clients that still have a batch (ordered by step
    count for the round, or, `presorted`, stored largest first so nothing is reordered), with the
    same weights, buffers and optimiser state, in the data's order, as the padded step that
    computes every client (Adam carried over from a round before, with unequal counters; BN-style
    buffers)."""
    from fed_tiny import tiny_fed

    from fedheads.core.batching import make_schedule
    from fedheads.core.protocol import RoundCtx
    from fedheads.core.train import local_train, order_by_steps
    from fedheads.core.tree import tree_leaves

    data = tiny_fed(M=5, seed=2)
    if presorted:
        data = data.by_size()[0]
    M = data.num_clients
    assert len(set(data.n_train)) > 1
    perm, _ = order_by_steps(make_schedule(list(data.n_train), data.client_index, 4, 2, 0, 0, data.device))
    assert (perm is None) == presorted
    torch.manual_seed(0)
    params = {"w": torch.randn(M, data.dim, 3) * 0.1, "b": torch.zeros(M, 3)}
    buffers = {"seen": torch.zeros(M, 1)}
    seen_rows: list[int] = []

    def loss_fn(p, b, x, y, m):
        seen_rows.append(x.shape[0])
        return (ops.masked_cross_entropy(ops.linear(x, p["w"], p["b"]), y.clamp_max(2), m),
                {"seen": b["seen"] + m.sum(1, keepdim=True)})

    cfg = OptimizerConfig(opt_name, lr=0.01, momentum=0.9 if opt_name == "sgd" else 0.0)
    ctx0 = RoundCtx(round=0, seed=0, participants=torch.arange(M), num_clients=M)
    ctx1 = RoundCtx(round=1, seed=0, participants=torch.arange(M), num_clients=M)
    runs = {}
    for rowwise in (False, True):
        seen_rows.clear()
        p, b, opt = local_train(params, buffers, None, cfg, loss_fn, data, ctx0, 4, 2, rowwise=rowwise)
        runs[rowwise] = local_train(p, b, opt, cfg, loss_fn, data, ctx1, 4, 2, rowwise=rowwise), list(seen_rows)
    (pa, ba, oa), rows_padded = runs[False]
    (pb, bb, ob), rows_prefix = runs[True]
    steps = [2 * -(-n // 4) for n in data.n_train]
    assert rows_padded == [M] * (2 * max(steps))
    assert rows_prefix == [sum(1 for t in steps if s < t) for s in range(max(steps))] * 2  # both rounds
    assert torch.equal(bb["seen"].view(-1), 2 * 2 * torch.tensor(data.n_train, dtype=torch.float32))
    for x, y in zip(tree_leaves((pa, ba, oa)), tree_leaves((pb, bb, ob))):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_rowwise_local_train_passes_each_steps_rows_of_consts() -> None:
    """`consts` (per-client tensors the loss reads, FedRep's personal head): the rowwise run, which
    reorders the clients and computes a prefix of them per step, gives the loss the consts' rows of
    the same clients, so it ends where the padded run reading the full tensor from its closure does."""
    from fed_tiny import tiny_fed

    from fedheads.core.protocol import RoundCtx
    from fedheads.core.train import local_train

    data = tiny_fed(M=5, seed=2)
    M = data.num_clients
    torch.manual_seed(0)
    params = {"w": torch.randn(M, data.dim, 3) * 0.1}
    scale = {"s": torch.linspace(0.5, 3.0, M).view(M, 1, 1)}  # a different value per client
    rows: list[int] = []

    def loss(p, x, y, m, c):
        rows.append(x.shape[0])
        return ops.masked_cross_entropy(ops.linear(x, p["w"], None) * c["s"], y.clamp_max(2), m), {}

    cfg = OptimizerConfig("adam", lr=0.05)
    ctx = RoundCtx(round=0, seed=0, participants=torch.arange(M), num_clients=M)
    want, _, _ = local_train(params, {}, None, cfg, lambda p, b, x, y, m: loss(p, x, y, m, scale), data, ctx, 4, 2)
    rows.clear()
    got, _, _ = local_train(params, {}, None, cfg, lambda p, b, x, y, m, c: loss(p, x, y, m, c), data, ctx, 4, 2,
                            rowwise=True, consts=scale)
    assert min(rows) < M, "the rowwise run computed a prefix"
    torch.testing.assert_close(got["w"], want["w"], rtol=1e-6, atol=1e-7)
