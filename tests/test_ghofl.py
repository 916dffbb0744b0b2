"""GH-OFL (Turazza et al., ICLR 2026; fedheads/algorithms/ghofl.py): the closed-form heads, the Fisher
subspace, the synthesis and the two trained heads equal to the authors' code on the same features;
the LDA equal to scikit-learn's shrinkage LDA on the pooled data; the statistics independent of the
partition; the engines, the summed path, partial participation, SecAgg+ and DP; the bytes sent."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fed_tiny import check_secure_form

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms import ghofl as G
from fedheads.algorithms.ccvr import shuffled
from fedheads.core import run
from fedheads.core.federation import LayoutConfig, to_layout
from fedheads.core.tree import tree_leaves
from fedheads.run.load import from_arrays

# ---------------------------------------------------------------- the authors' code (oracle)
# FabioTur-dev/One-Shot-FL client/run_client.py aggregate_client_stats_x and server/GH_OFL_server.py,
# transcribed; changed only where data comes in: the feature dimension is a parameter (FEATURE_DIM),
# client statistics are handed over as dicts (not client_*.pt files), the DataLoaders are lists
# of batches, and the device is the CPU.
MIN_EPS = 1e-6


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def aggregate_client_stats_x(model, loader, num_classes, device, dataset_name, d):
    C = num_classes
    A = torch.zeros(C, d, dtype=torch.float64, device=device)
    SUMSQ = torch.zeros(C, d, dtype=torch.float64, device=device)
    N = torch.zeros(C, dtype=torch.long, device=device)
    B = torch.zeros(d, d, dtype=torch.float64, device=device)
    S = torch.zeros(C, d, d, dtype=torch.float64, device=device)
    for imgs, y in loader:
        imgs = imgs.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True).to(torch.long)
        x32 = model(imgs).to(torch.float32)
        x64 = x32.to(torch.float64)
        B += x64.t().mm(x64)
        for cls in y.unique():
            ci = int(cls.item())
            mask = (y == cls)
            if mask.any():
                xc = x64[mask]
                A[ci] += xc.sum(dim=0)
                SUMSQ[ci] += (xc * xc).sum(dim=0)
                N[ci] += int(mask.sum().item())
                S[ci] += xc.t().mm(xc)
    return {"A_per_class_x": A.detach().cpu(), "SUMSQ_per_class_x": SUMSQ.detach().cpu(),
            "N_per_class": N.detach().cpu(), "B_global_x": B.detach().cpu(), "S_per_class_x": S.detach().cpu()}


def symmetrize(S):
    return 0.5 * (S + S.t())


def shrink_cov(S, alpha):
    S = symmetrize(S)
    d = S.shape[0]
    tr = torch.trace(S).clamp_min(0.0)
    return (1.0 - alpha) * S + alpha * (tr / max(1, d)) * torch.eye(d, dtype=S.dtype, device=S.device)


def invsqrt_psd(S, eps=1e-12):
    S = symmetrize(S)
    evals, evecs = torch.linalg.eigh(S)
    evals = evals.clamp_min(eps)
    return (evecs * evals.rsqrt().unsqueeze(0)) @ evecs.t()


def aggregate_clients_x(dicts, num_classes):
    A_sum = Q_sum = N_sum = B_sum = S_sum = None
    for dct in dicts:
        A = dct["A_per_class_x"].to(torch.float64)
        B = dct["B_global_x"].to(torch.float64)
        N = dct["N_per_class"].to(torch.long)
        Q = dct.get("SUMSQ_per_class_x", None)
        S = dct.get("S_per_class_x", None)
        S = S.to(torch.float64) if S is not None else None
        Q = Q.to(torch.float64)
        if A_sum is None:
            A_sum, N_sum, B_sum, Q_sum = torch.zeros_like(A), torch.zeros_like(N), torch.zeros_like(B), torch.zeros_like(Q)
            if S is not None:
                S_sum = torch.zeros_like(S)
        A_sum += A
        N_sum += N
        B_sum += B
        Q_sum += Q
        if S is not None:
            S_sum += S
    C, d = A_sum.shape
    N_total = int(N_sum.sum().item())
    mu = A_sum / N_sum.clamp_min(1).unsqueeze(1)
    pri = (N_sum.to(torch.float64) / float(max(1, N_total))).clamp_min(1e-12)
    logp = torch.log(pri)
    SW = B_sum.clone()
    for c in range(C):
        Nc = int(N_sum[c].item())
        if Nc > 0:
            mc = mu[c].unsqueeze(1)
            SW -= float(Nc) * (mc @ mc.t())
    denom = float(max(1, N_total - C))
    Sigma_pool = symmetrize(SW / denom)
    Ez2 = Q_sum / N_sum.clamp_min(1).unsqueeze(1)
    Var_diag = (Ez2 - mu * mu).clamp_min(1e-6)
    Sigma_cls = None
    if S_sum is not None:
        Sigma_cls = torch.zeros(C, d, d, dtype=torch.float64)
        for c in range(C):
            Nc = int(N_sum[c].item())
            mc = mu[c].unsqueeze(1)
            if Nc > 1:
                Sigma_cls[c] = (S_sum[c] - float(Nc) * (mc @ mc.t())) / float(Nc - 1)
            else:
                Sigma_cls[c] = Sigma_pool.clone()
        Sigma_cls = 0.5 * (Sigma_cls + Sigma_cls.transpose(1, 2))
    return dict(C=C, d=d, N_total=N_total, mu=mu, pri=pri, logp=logp, Sigma_pool=Sigma_pool, Var_diag=Var_diag,
                Sigma_cls=Sigma_cls)


def logits_nbdiag_cpu(x64, mu64, var_diag64, logp64):
    dif = x64.unsqueeze(1) - mu64.unsqueeze(0)
    quad = 0.5 * (dif * dif / var_diag64.unsqueeze(0)).sum(dim=2)
    logdet = 0.5 * torch.log(var_diag64).sum(dim=1).unsqueeze(0)
    return logp64.unsqueeze(0) - quad - logdet


def logits_lda_cpu(x64, mu64, Sig64, logp64, shrink):
    S = shrink_cov(Sig64, shrink)
    S = symmetrize(S) + MIN_EPS * torch.eye(S.shape[0], dtype=torch.float64, device=S.device)
    W = torch.linalg.solve(S, mu64.t())
    b = (-0.5 * (mu64 * W.t()).sum(dim=1) + logp64).unsqueeze(0)
    return x64 @ W + b


class QDAFullFastGPU:
    def __init__(self, mu64_cpu, Sigma_cls64_cpu, logp64_cpu, shrink, device):
        self.device = device
        self.shrink = float(shrink)
        C, d = mu64_cpu.shape
        self.C, self.d = int(C), int(d)
        self.mu = mu64_cpu.to(device, dtype=torch.float32)
        self.logp = logp64_cpu.to(device, dtype=torch.float32)
        Sig = Sigma_cls64_cpu.to(device, dtype=torch.float32)
        I = torch.eye(d, device=device, dtype=torch.float32)  # noqa: E741
        self.L_list: list[torch.Tensor] = []
        self.logdet_half = torch.empty(C, device=device, dtype=torch.float32)
        for c in range(C):
            Sc = shrink_cov(Sig[c], self.shrink)
            Sc = symmetrize(Sc) + (MIN_EPS * I)
            L = torch.linalg.cholesky(Sc)
            self.L_list.append(L)
            self.logdet_half[c] = torch.log(torch.diag(L)).sum()

    @torch.no_grad()
    def logits(self, x):
        B = x.shape[0]
        out = torch.empty(B, self.C, device=self.device, dtype=torch.float32)
        for c in range(self.C):
            dif = x - self.mu[c].unsqueeze(0)
            sol = torch.cholesky_solve(dif.unsqueeze(2), self.L_list[c]).squeeze(2)
            quad = 0.5 * (dif * sol).sum(dim=1)
            out[:, c] = self.logp[c] - quad - self.logdet_half[c]
        return out


def fisher_subspace(mu, pri, Sigma_pool, lda_shrink, energy, max_k):
    mu = mu.to(torch.float64)
    pri = pri.to(torch.float64)
    C, d = mu.shape
    mbar = (pri.unsqueeze(1) * mu).sum(dim=0, keepdim=True)
    SB = torch.zeros(d, d, dtype=torch.float64)
    for c in range(C):
        dm = (mu[c:c + 1] - mbar)
        SB += float(pri[c].item()) * (dm.t() @ dm)
    SB = symmetrize(SB)
    SW = shrink_cov(Sigma_pool.to(torch.float64), lda_shrink)
    SW = symmetrize(SW) + MIN_EPS * torch.eye(d, dtype=torch.float64)
    W_invsqrt = invsqrt_psd(SW, eps=1e-12)
    A = symmetrize(W_invsqrt @ SB @ W_invsqrt)
    lam, U = torch.linalg.eigh(A)
    lam = lam.clamp_min(0)
    idx = torch.argsort(lam, descending=True)
    lam = lam[idx]
    U = U[:, idx]
    if lam.numel() == 0 or float(lam.sum().item()) <= 0:
        kf = min(2, d)
        V = torch.eye(d, dtype=torch.float64)[:, :kf]
        return V.contiguous(), kf, lam
    csum = torch.cumsum(lam, dim=0)
    tot = float(csum[-1].item())
    kf = int((csum / max(tot, 1e-12) >= energy).nonzero(as_tuple=True)[0][0].item() + 1)
    kf = max(2, min(kf, max_k, d))
    V = (W_invsqrt @ U[:, :kf]).contiguous()
    return V, kf, lam


def synthesize_fisher(mu, Sigma_pool, Sigma_cls, V, ns_per_class, syn_shrink, base_tau, tau_clip_rng, seed, use_class_cov):
    set_seed(seed)
    mu64 = mu.to(torch.float64)
    V64 = V.to(torch.float64)
    C = mu64.shape[0]
    kf = V64.shape[1]
    tau = max(tau_clip_rng[0], min(tau_clip_rng[1], float(base_tau)))
    taus = [float(tau) for _ in range(C)]
    mu_f = mu64 @ V64
    Zs, Ys = [], []
    if use_class_cov and (Sigma_cls is not None):
        for c in range(C):
            Sc = shrink_cov(Sigma_cls[c].to(torch.float64), syn_shrink)
            Sf = V64.t() @ symmetrize(Sc) @ V64
            Sf = symmetrize(Sf) + MIN_EPS * torch.eye(kf, dtype=torch.float64)
            Sf = (tau ** 2) * Sf + MIN_EPS * torch.eye(kf, dtype=torch.float64)
            L = torch.linalg.cholesky(Sf)
            eps = (torch.randn(ns_per_class, kf, dtype=torch.float64) @ L.t())
            z = mu_f[c].unsqueeze(0) + eps
            y = torch.full((ns_per_class,), c, dtype=torch.long)
            Zs.append(z.to(torch.float32))
            Ys.append(y)
    else:
        Sp = shrink_cov(Sigma_pool.to(torch.float64), syn_shrink)
        Sf = V64.t() @ symmetrize(Sp) @ V64
        Sf = symmetrize(Sf) + MIN_EPS * torch.eye(kf, dtype=torch.float64)
        Sf = (tau ** 2) * Sf + MIN_EPS * torch.eye(kf, dtype=torch.float64)
        L = torch.linalg.cholesky(Sf)
        for c in range(C):
            eps = (torch.randn(ns_per_class, kf, dtype=torch.float64) @ L.t())
            z = mu_f[c].unsqueeze(0) + eps
            y = torch.full((ns_per_class,), c, dtype=torch.long)
            Zs.append(z.to(torch.float32))
            Ys.append(y)
    return torch.cat(Zs, dim=0), torch.cat(Ys, dim=0), taus


def build_gaussians_fisher(mu, pri, Sigma_pool, V, lda_shrink, device):
    mu64 = mu.to(torch.float64)
    pri64 = pri.to(torch.float64)
    V64 = V.to(torch.float64)
    kf = V64.shape[1]
    mu_f = (mu64 @ V64).to(device, dtype=torch.float64)
    logp = torch.log(pri64.clamp_min(1e-12)).to(device, dtype=torch.float64)
    Sig_f_pool = V64.t() @ shrink_cov(Sigma_pool.to(torch.float64), lda_shrink) @ V64
    Sig_f_pool = symmetrize(Sig_f_pool) + MIN_EPS * torch.eye(kf, dtype=torch.float64)
    Sig_f_pool = Sig_f_pool.to(device, dtype=torch.float64)
    sigma2_nb = float(torch.trace(Sig_f_pool).item() / float(max(1, kf)))
    sigma2_nb = max(sigma2_nb, 1e-12)
    return dict(mu_f=mu_f, Sig_f_pool=Sig_f_pool, logp=logp, sigma2_nb=sigma2_nb, kf=kf)


@torch.no_grad()
def lda_scores_f(zf, g):
    z64 = zf.to(torch.float64)
    mu_f = g["mu_f"]
    Sig = g["Sig_f_pool"]
    logp = g["logp"]
    S = symmetrize(Sig) + MIN_EPS * torch.eye(Sig.shape[0], dtype=torch.float64, device=Sig.device)
    W = torch.linalg.solve(S, mu_f.t())
    b = -0.5 * (mu_f * W.t()).sum(dim=1) + logp
    out = z64 @ W + b.unsqueeze(0)
    return out.to(torch.float32)


@torch.no_grad()
def nb_scores_f(zf, g):
    z = zf.to(torch.float32)
    mu = g["mu_f"].to(torch.float32)
    logp = g["logp"].to(torch.float32)
    sigma2 = float(g["sigma2_nb"])
    kf = int(g["kf"])
    mu2 = (mu * mu).sum(dim=1)
    z2 = (z * z).sum(dim=1)
    zmu = z @ mu.t()
    quad = 0.5 * (z2.unsqueeze(1) - 2.0 * zmu + mu2.unsqueeze(0)) / sigma2
    logdet = 0.5 * kf * math.log(sigma2 + 1e-12)
    return logp.unsqueeze(0) - quad - logdet


class LinearHead(nn.Module):
    def __init__(self, in_dim, num_classes):
        super().__init__()
        self.fc = nn.Linear(in_dim, num_classes, bias=True)

    def forward(self, z):
        return self.fc(z)


class ProtoHyperResidual(nn.Module):
    def __init__(self, in_dim, num_classes, rank):
        super().__init__()
        r = int(min(rank, in_dim))
        self.U = nn.Linear(in_dim, r, bias=False)
        self.V = nn.Linear(r, num_classes, bias=True)

    def forward(self, z):
        return self.V(self.U(z))


def kd_mix_loss(student, teacher, y, alpha_kd, T):
    ce = F.cross_entropy(student, y)
    if alpha_kd <= 0:
        return ce
    logp_s = F.log_softmax(student / T, dim=1)
    p_t = F.softmax(teacher / T, dim=1).detach()
    kl = F.kl_div(logp_s, p_t, reduction="batchmean")
    return alpha_kd * (T * T) * kl + (1.0 - alpha_kd) * ce


def train_fishermix(dl, fm, epochs, lr, wd):
    opt = torch.optim.AdamW(fm.parameters(), lr=lr, weight_decay=wd)
    for _ep in range(1, epochs + 1):
        fm.train()
        for z, y in dl:
            logits = fm(z)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return fm


def train_protohyper(dl, ph, g_f, epochs, lr, wd, kd_alpha, kd_T, teacher_blend):
    opt = torch.optim.AdamW(ph.parameters(), lr=lr, weight_decay=wd)
    w = float(teacher_blend)
    for _ep in range(1, epochs + 1):
        ph.train()
        for z, y in dl:
            with torch.no_grad():
                base = nb_scores_f(z, g_f)
                lda = lda_scores_f(z, g_f)
                teacher = w * lda + (1.0 - w) * base
            student = base + ph(z)
            loss = kd_mix_loss(student, teacher, y, alpha_kd=kd_alpha, T=kd_T)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return ph


# ---------------------------------------------------------------- helpers
def gaussians_federation(seed=0, M=4, C=4, D=6, n=(40, 90), shift=0.2):
    """Clients with every class well sampled (N_c > D), a per-client shift; label skew in the sizes."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(C, D)) * 2.0
    scales = [np.diag(rng.uniform(0.5, 1.5, D)) + 0.3 * rng.normal(size=(D, D)) for _ in range(C)]
    clients = []
    for k in range(M):
        y = rng.integers(0, C, int(rng.integers(*n)))
        x = centres[y] + np.einsum("nd,nde->ne", rng.normal(size=(len(y), D)), np.stack(scales)[y]) + shift * k
        yt = rng.integers(0, C, 25)
        xt = centres[yt] + np.einsum("nd,nde->ne", rng.normal(size=(len(yt), D)), np.stack(scales)[yt]) + shift * k
        clients.append((x.astype(np.float32), y, xt.astype(np.float32), yt))
    return clients, C


def _run(clients, C, engine="vectorized", rounds=1, fraction=1.0, budget=None, **cfg):
    kw = {} if budget is None else {"message_budget": budget}
    return run(create_algorithm("ghofl", **cfg), from_arrays(clients, C), rounds, seed=0, engine=engine,
               fraction=fraction, progress=False, **kw)


def _oracle_stats(clients, C, batch=16):
    D = clients[0][0].shape[1]
    dicts = []
    for x, y, _, _ in clients:
        loader = [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])) for i in range(0, len(y), batch)]
        dicts.append(aggregate_client_stats_x(lambda im: im, loader, C, "cpu", "cifar10", D))
    return aggregate_clients_x(dicts, C)


def _moments(ss, full=True):
    return G.moments(ss.sums, ss.sumsq, ss.counts, ss.gram, ss.class_sq if full else None)


def _test_x(clients):
    return torch.from_numpy(np.concatenate([c[2] for c in clients]))


def _scores(res, x, head="qda"):
    alg = create_algorithm("ghofl", head=head)
    return alg.predict(res.client_state, res.server_state, x.unsqueeze(0), torch.ones(1, x.shape[0], dtype=torch.bool))


def _close_up_to_sign(a, b, **tol):
    sign = torch.sign((a * b).sum(0))
    torch.testing.assert_close(a * sign, b, **tol)


# ---------------------------------------------------------------- tests
def test_the_closed_form_heads_equal_the_authors_code():
    clients, C = gaussians_federation(seed=1)
    agg = _oracle_stats(clients, C)
    res = _run(clients, C, head="qda")
    ss, m = res.server_state, _moments(res.server_state)
    for ours, theirs in ((m.mean, agg["mu"]), (m.var, agg["Var_diag"]), (m.pooled, agg["Sigma_pool"]),
                         (m.class_cov, agg["Sigma_cls"]), (ss.log_prior, agg["logp"])):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    x = _test_x(clients)
    x64 = x.double()
    lda_shrink, qda_shrink = 0.05, 0.1  # the configs' values, our defaults
    sig_pool_shrunk = symmetrize(shrink_cov(agg["Sigma_pool"], lda_shrink)) + MIN_EPS * torch.eye(x.shape[1],
                                                                                                   dtype=torch.float64)
    out = _scores(res, x)
    torch.testing.assert_close(out["nb"][0], logits_nbdiag_cpu(x64, agg["mu"], agg["Var_diag"], agg["logp"]),
                               rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out["lda"][0], logits_lda_cpu(x64, agg["mu"], sig_pool_shrunk, agg["logp"], shrink=0.0),
                               rtol=1e-9, atol=1e-9)
    qda = QDAFullFastGPU(agg["mu"], agg["Sigma_cls"], agg["logp"], qda_shrink, torch.device("cpu")).logits(x)
    torch.testing.assert_close(out["qda"][0].float(), qda, rtol=1e-4, atol=1e-3)  # theirs in float32
    assert bool((out["qda"][0].argmax(1) == qda.argmax(1)).all())
    assert torch.equal(out["main"], out["qda"])


def test_the_fisher_subspace_and_the_synthesis_equal_the_authors_code(monkeypatch):
    clients, C = gaussians_federation(seed=2, C=5, D=8)
    agg = _oracle_stats(clients, C)
    res = _run(clients, C, head="protohyper", syn_per_class=64, ph_epochs=1)
    m = _moments(res.server_state)
    for energy, max_k in ((0.995, 128), (0.6, 128), (0.995, 2)):
        ours = G.fisher_subspace(m, 0.05, energy, max_k)
        theirs, kf, _ = fisher_subspace(agg["mu"], agg["pri"], agg["Sigma_pool"], 0.05, energy, max_k)
        assert ours.shape[1] == kf
        _close_up_to_sign(ours, theirs, rtol=1e-8, atol=1e-10)
    v = res.server_state.fisher
    torch.testing.assert_close(v, G.fisher_subspace(m, 0.05, 0.995, 128))
    K = v.shape[1]
    for class_cov in (True, False):
        # the authors' draws replaced by the identity: each class's draws are then the rows of L_c^T
        monkeypatch.setattr(torch, "randn", lambda n, k, dtype=None: torch.eye(n, k, dtype=dtype))
        z, y, _ = synthesize_fisher(agg["mu"], agg["Sigma_pool"], agg["Sigma_cls"], v, K, 0.05, 0.9, (0.6, 1.4), 0,
                                    class_cov)
        monkeypatch.undo()
        theirs = (z.double().view(C, K, K) - (agg["mu"] @ v).unsqueeze(1))
        ours = G.synthesis_factors(m, v, 0.05, 0.9, class_cov).transpose(1, 2)
        torch.testing.assert_close(ours.float().double(), theirs, rtol=1e-5, atol=1e-5)
    zs, ys = G.synthetic(m, v, G.synthesis_factors(m, v, 0.05, 0.9, True), 3000, seed=0)
    for c in range(C):  # the draws have the intended law: mean mu_c V, covariance L_c L_c^T
        zc = zs[ys == c].double()
        f = G.synthesis_factors(m, v, 0.05, 0.9, True)[c]
        torch.testing.assert_close(zc.mean(0), (m.mean[c] @ v), atol=0.1 * float(f.diagonal().max()), rtol=0)
        torch.testing.assert_close(torch.cov(zc.T), f @ f.T, atol=0.15 * float((f @ f.T).diagonal().max()), rtol=0)


class _Batches:
    """The batches of our keyed shuffle, a new order each epoch, as a DataLoader iterates."""

    def __init__(self, z, y, batch, key):
        self.z, self.y, self.batch, self.key, self.epoch = z, y, batch, key, 0

    def __iter__(self):
        perm = shuffled(self.z.shape[0], *self.key, self.epoch)
        self.epoch += 1
        for a in range(0, len(perm), self.batch):
            yield self.z[perm[a:a + self.batch]], self.y[perm[a:a + self.batch]]


def test_the_trained_heads_equal_the_authors_training():
    clients, C = gaussians_federation(seed=3, C=5, D=8)
    agg = _oracle_stats(clients, C)
    cfg = G.GHOFLConfig(head="protohyper", syn_per_class=200, fm_epochs=3, ph_epochs=3, fm_batch=128, ph_batch=64)
    res = _run(clients, C, **{k: getattr(cfg, k) for k in ("head", "syn_per_class", "fm_epochs", "ph_epochs",
                                                            "fm_batch", "ph_batch")})
    m = _moments(res.server_state)
    v = res.server_state.fisher
    K = v.shape[1]
    z, y = G.synthetic(m, v, G.synthesis_factors(m, v, 0.05, 0.9, True), 200, seed=0)
    # FisherMix: fit_linear with AdamW against train_fishermix, from the same initial nn.Linear
    fm = LinearHead(K, C)
    w0, b0 = G.uniform_init((K, C), K, 0, 0xF1, device=z.device), G.uniform_init((C,), K, 0, 0xF2, device=z.device)
    with torch.no_grad():
        fm.fc.weight.copy_(w0.T)
        fm.fc.bias.copy_(b0)
    train_fishermix(_Batches(z, y, 128, (0, 0xF3)), fm, 3, 8e-4, 3e-4)
    ours = G.fit_linear({"cls.weight": w0, "cls.bias": b0}, z, y, optimizer="adamw", lr=8e-4, weight_decay=3e-4,
                        epochs=3, batch_size=128, key=(0, 0xF3))
    torch.testing.assert_close(ours["cls.weight"], fm.fc.weight.detach().T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["cls.bias"], fm.fc.bias.detach(), rtol=1e-5, atol=1e-6)
    # Proto-Hyper: our z-space Gaussians and training against build_gaussians_fisher + train_protohyper
    g_f = build_gaussians_fisher(agg["mu"], agg["pri"], agg["Sigma_pool"], v, 0.05, "cpu")
    g = G.z_gaussians(m, v, 0.05)
    torch.testing.assert_close(G.nb_z(z, g.mean, g.log_prior, g.var), nb_scores_f(z, g_f), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(G.lda_z(z, g), lda_scores_f(z, g_f), rtol=1e-6, atol=1e-5)
    r = min(128, K)
    p0 = {"u": G.uniform_init((K, r), K, 0, 0xB1, device=z.device), "v": G.uniform_init((r, C), r, 0, 0xB2, device=z.device),
          "b": G.uniform_init((C,), r, 0, 0xB3, device=z.device)}
    ph = ProtoHyperResidual(K, C, 128)
    with torch.no_grad():
        ph.U.weight.copy_(p0["u"].T)
        ph.V.weight.copy_(p0["v"].T)
        ph.V.bias.copy_(p0["b"])
    train_protohyper(_Batches(z, y, 64, (0, 0xB4)), ph, g_f, 3, 1e-3, 5e-4, 0.4, 4.0, 0.7)
    out = G.train_protohyper(z, y, g, p0, cfg, (0, 0xB4))
    torch.testing.assert_close(out["u"], ph.U.weight.detach().T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["v"], ph.V.weight.detach().T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.server_state.z_weight, out["u"] @ out["v"], rtol=1e-5, atol=1e-6)
    # the run's head predicts as the authors' student does: nb_scores_f(z) + ph(z), z = x V in float32
    x = _test_x(clients)
    zf = (x.double() @ v).float()
    with torch.no_grad():
        student = nb_scores_f(zf, g_f) + ph(zf)
    got = create_algorithm("ghofl", **{k: getattr(cfg, k) for k in ("head",)}).predict(
        res.client_state, res.server_state, x.unsqueeze(0), torch.ones(1, len(x), dtype=torch.bool))
    torch.testing.assert_close(got["protohyper"][0], student, rtol=1e-4, atol=1e-3)


def test_lda_is_scikit_learns_shrinkage_lda_on_the_pooled_data():
    """sklearn's lsqr LDA with a fixed shrinkage averages the classes' shrunk covariances by the
    priors, i.e. shrinks the pooled within-class covariance with denominator N; GH-OFL's divides by
    N - C. With that denominator (a covariance estimator) the two are one classifier; sklearn's
    own default differs from it by the factor N / (N - C) only."""
    from sklearn.base import BaseEstimator
    from sklearn.covariance import empirical_covariance, shrunk_covariance
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    clients, C = gaussians_federation(seed=4, D=10)
    x = np.concatenate([c[0] for c in clients]).astype(np.float64)
    y = np.concatenate([c[1] for c in clients])
    N, alpha = len(y), 0.05

    class Unbiased(BaseEstimator):
        def fit(self, X):
            self.covariance_ = shrunk_covariance(empirical_covariance(X), alpha) * N / (N - C)
            return self

    res = _run(clients, C, lda_shrink=alpha)
    ss = res.server_state
    xt = np.concatenate([c[2] for c in clients]).astype(np.float64)
    sk = LinearDiscriminantAnalysis(solver="lsqr", covariance_estimator=Unbiased()).fit(x, y)
    torch.testing.assert_close(G.shrink(_moments(ss, full=False).pooled, alpha), torch.from_numpy(sk.covariance_),
                               rtol=1e-10, atol=1e-12)
    ours = (torch.from_numpy(xt) @ ss.lda_weight + ss.lda_bias).numpy()
    np.testing.assert_allclose(ours, sk.decision_function(xt), rtol=1e-5, atol=1e-5)  # ours: + 2e-6 I
    plain = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=alpha).fit(x, y)
    np.testing.assert_allclose(plain.covariance_ * N / (N - C), sk.covariance_, rtol=1e-12)
    assert (plain.predict(xt) == ours.argmax(1)).mean() > 0.97


def test_the_statistics_do_not_depend_on_the_partition():
    clients, C = gaussians_federation(seed=5)
    x = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    ref = _run(clients, C, head="protohyper", syn_per_class=100, ph_epochs=2).server_state
    for parts in (1, 3, 9):
        split = np.array_split(order, parts)
        again = [(x[i], y[i], clients[0][2], clients[0][3]) for i in split]
        ss = _run(again, C, head="protohyper", syn_per_class=100, ph_epochs=2).server_state
        for f in ("mean", "var", "lda_weight", "lda_bias", "qda_factor", "qda_bias", "fisher"):
            torch.testing.assert_close(getattr(ss, f), getattr(ref, f), rtol=1e-8, atol=1e-9)
        torch.testing.assert_close(ss.z_weight, ref.z_weight, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head", ["qda", "protohyper", "fishermix"])
def test_the_engines_and_the_summed_path_agree(head):
    clients, C = gaussians_federation(seed=6, M=6)
    cfg = {"head": head, "syn_per_class": 100, "fm_epochs": 2, "ph_epochs": 2}
    loop = _run(clients, C, engine="loop", **cfg)
    data = from_arrays(clients, C)
    bucketed = to_layout(data.by_size()[0], LayoutConfig("bucketed", waste=1.0, bucket_clients=2))
    runs = [_run(clients, C, **cfg), _run(clients, C, budget=1, **cfg),  # budget=1: the summed path
            run(create_algorithm("ghofl", **cfg), bucketed, 1, seed=0, progress=False)]
    for other in runs:
        assert other.history[0].comm == loop.history[0].comm
        for ta, tb in zip(tree_leaves(other.server_state), tree_leaves(loop.server_state)):
            torch.testing.assert_close(ta, tb, rtol=1e-6, atol=1e-7)
    acc = loop.history[0].accuracy
    assert set(acc) == {"main", "nb", "lda", "qda", *([head] if head != "qda" else [])}
    torch.testing.assert_close(runs[0].history[0].accuracy["main"], acc["main"])


def test_partial_participation_reaches_the_one_round_heads():
    clients, C = gaussians_federation(seed=7, M=6)
    cfg = {"head": "protohyper", "syn_per_class": 100, "ph_epochs": 2}
    full = _run(clients, C, **cfg).server_state
    for engine in ("vectorized", "loop"):
        part = _run(clients, C, engine=engine, rounds=12, fraction=0.5, **cfg).server_state
        assert int(part.counts.sum()) == sum(len(c[1]) for c in clients)
        for ta, tb in zip(tree_leaves(part), tree_leaves(full)):
            torch.testing.assert_close(ta, tb, rtol=1e-6, atol=1e-7)


def test_bytes_sent_are_the_classes_each_client_holds():
    clients, C = gaussians_federation(seed=8, M=5, C=6, D=7)
    x1, y1, xt1, yt1 = clients[1]
    clients[1] = (x1[y1 < 2], y1[y1 < 2], xt1, yt1)  # client 1 holds classes 0 and 1 only
    D = 7
    held = [len(np.unique(c[1])) for c in clients]
    for head, full in (("lda", False), ("qda", True)):
        want_v = sum(D * D + h * (2 * D + 2 + (D * D if full else 0)) for h in held)
        want_b = sum(8 * D * D + h * (8 * (2 * D + (D * D if full else 0)) + 16) for h in held)
        for budget in (None, 1):
            comm = _run(clients, C, head=head, budget=budget).history[0].comm
            assert abs(comm.up_values - want_v) <= len(clients)  # per-client average rounded, times M
            assert abs(comm.up_bytes - want_b) <= len(clients)
    alg = create_algorithm("ghofl", head="qda")
    from fedheads.core.protocol import HeadArch

    assert alg.paper_round_comm(HeadArch((D,), 0, C), 5).upload == C * (2 * D + 1) + D * D + C * D * D


def test_the_secure_form_gives_the_plain_heads():
    clients, C = gaussians_federation(seed=9, M=4)
    check_secure_form(create_algorithm("ghofl", head="qda"), from_arrays(clients, C))


def test_under_dp_the_heads_are_defined_and_close_under_vanishing_noise():
    from fedheads.privacy import Mechanism, Private

    clients, C = gaussians_federation(seed=10, M=5)
    data = from_arrays(clients, C)
    plain = _run(clients, C, head="qda").server_state
    tiny = run(Private(create_algorithm("ghofl", head="qda"), Mechanism(noise_multiplier=1e-9, clip=100.0,
                                                                       noise_seed=1)), data, 1, seed=0, progress=False)
    for f in ("mean", "var", "lda_weight", "qda_bias"):
        torch.testing.assert_close(getattr(tiny.server_state, f), getattr(plain, f), rtol=1e-4, atol=1e-5)
    noisy = run(Private(create_algorithm("ghofl", head="qda"), Mechanism(epsilon=1.0, delta=1e-5, clip=1.0,
                                                                        noise_seed=2)), data, 1, seed=0, progress=False)
    out = _scores(noisy, _test_x(clients))
    for k in ("nb", "lda", "qda"):  # noisy covariances projected onto the PSD cone: every head is defined
        s = out[k][0][:, noisy.server_state.present]
        assert bool(torch.isfinite(s).all()), k


def test_linear_heads_predict_as_the_rules():
    clients, C = gaussians_federation(seed=11)
    x = _test_x(clients)
    for head in ("lda", "fishermix", "protohyper"):
        res = _run(clients, C, head=head, syn_per_class=100, fm_epochs=2, ph_epochs=2)
        alg = create_algorithm("ghofl", head=head)
        lin = alg.linear_head(res.server_state)
        main = alg.predict(res.client_state, res.server_state, x.unsqueeze(0), torch.ones(1, len(x), dtype=torch.bool))
        got = x @ lin["cls.weight"] + lin["cls.bias"]
        assert bool((got.argmax(1) == main["main"][0].argmax(1)).all()), head
    for head in ("nb", "qda"):
        assert create_algorithm("ghofl", head=head).linear_head(_run(clients, C, head=head).server_state) is None


def test_settings_and_absent_classes_are_said_in_one_line():
    with pytest.raises(UserError, match="head 'svm'"):
        create_algorithm("ghofl", head="svm")
    with pytest.raises(UserError, match="class_covariances"):
        create_algorithm("ghofl", head="qda", class_covariances=False)
    with pytest.raises(UserError, match="lda_shrink"):
        create_algorithm("ghofl", lda_shrink=1.5)
    clients, C = gaussians_federation(seed=12, C=4)
    res = _run(clients, C + 1)  # class 4: no client holds it
    alg = create_algorithm("ghofl")
    (note,) = alg.trained_notes(res.server_state, ["a", "b", "c", "d", "e"])
    assert "class(es) e" in note
    assert float(res.final_accuracy().mean()) > 0.5
    out = _scores(res, _test_x(clients), "lda")
    assert bool(torch.isneginf(out["lda"][0][:, 4]).all())


def test_class_covariances_are_sent_only_where_a_head_needs_them():
    for head, full in (("lda", False), ("nb", False), ("qda", True), ("fishermix", True), ("protohyper", True)):
        assert G.GHOFLConfig(head=head).sends_class_covariances is full
    assert G.GHOFLConfig(head="protohyper", syn_class_cov=False).sends_class_covariances is False
    assert G.GHOFLConfig(head="lda", class_covariances=True).sends_class_covariances is True
