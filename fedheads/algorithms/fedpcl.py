"""FedPCL: Tan et al., "Federated Learning from Pre-Trained Models: A Contrastive Learning
Approach", NeurIPS 2022 (Sec. 4, Algorithm 1, Sec. 5.1, Appendix A Table 7; equations numbered
as in the NeurIPS version).

Per client: projection z(x) = L2(BN(ReLU(FC(x))))  (Table 7, FC(K*d, 256)) on the concatenated
backbone features x (Eq. 1-2). Per round (Algorithm 1):
- client: E local epochs minimising L = L_g + L_p (Eq. 10) with tau = 0.07, then local
  prototypes C_i^(j) = mean of z over the client's FULL training set of class j, eval mode (Eq. 5,
  Algorithm 1 line 8; not the authors' shuffled drop_last loader, which can drop a rare class);
- server: global prototypes (Eq. 6) and the padded local sets (Eq. 7) of every client seen so far,
  all sent back to every client.
Round 0 realises Algorithm 1 line 1 "Initialize prototype sets": clients upload the prototypes of
their initial heads and, in the paper variant, train nothing (the paper does not say how the sets
are initialised; there is nothing to contrast against before the first upload).

Choices, stated explicitly (see tests/test_fedpcl.py for hand-computed cases):
- A(y) = {y_a != y} in the denominators of Eq. 8/9 is implemented EXACTLY as written: the positive
  prototype is not in the denominator (unlike InfoNCE/SupCon). Classes absent from a prototype set
  (nobody has them yet) are left out of A(y); a sample with no negative or no positive prototype
  contributes 0. The sum over D_i in Eq. 8/9 is taken as the mean over each mini-batch.
- Eq. 6 as printed, (1/|N_j|) sum_i (|D_ij|/N_j) C_i^(j), shrinks the prototype by 1/|N_j|; the
  default `aggregation="weighted"` is the count-weighted mean sum_i |D_ij| C_i^(j) / N_j that the
  text intends ("eq6_literal" is offered; "mean" is the authors' code).
- With partial participation, Eq. 6 uses this round's participants (classes none of them holds
  keep their previous global prototype) and Eq. 7/9 use the latest set of every client seen so far.
- Inference: nearest LOCAL prototype by inner product (Sec. 4, "Prototype-based Inference").

`variant="code"` follows the authors' code (GitHub yuetan031/FedPCL: exps/federated_main.py,
lib/update.py LocalUpdate.update_weights_lg, lib/losses.py ConLoss, lib/models/models.py
ProjandDeci). Everything that differs from the paper variant (each item is also a config field,
so it can be switched on its own):
- head: z = L2(ReLU(fc1(x))), NO BatchNorm (ProjandDeci; Table 7 lists BN(256)), so z >= 0
  (`batch_norm`);
- loss: no L_g; for EACH padded local set p a SupCon-style loss whose anchors are the set's
  prototype of the sample's label and whose contrast set is the batch features (V views; cached
  features give V identical copies, `code_views`), self-pair excluded, summed (not averaged) over
  the sets; the code's cross-entropy term is computed but multiplied by 0;
- round 0: the same local epochs run on that zero loss, so Adam steps on the weight decay alone
  (grad = wd * theta) and the decayed weights are kept; the prototypes come from them;
- training batches: shuffled with drop_last (`drop_last`): a client with fewer than batch_size
  samples never trains (the authors' code would divide by zero there). Prototypes still use the
  full training set (their prototype loader is the same drop_last loader: a known bug, not kept);
- server: unweighted mean over clients (`aggregation="mean"`);
- inference: squared distance (mean over dims) to the local prototypes, a missing class at
  distance 100 (`inference="sqdist"`), with the prototypes as uploaded, i.e. noised when noise is
  on (`noisy_inference`: the code stores the noised set and classifies with it, Table 15).
`binarize_features` reproduces the code's L2-normalisation over a size-1 axis (x -> sign x).
Noise on uploaded prototypes (Appendix A.2.4, Table 15): x~ = (1 - p) x + e, e ~ Laplace(0, s) or
N(0, s^2), seeded by (seed, round, client, class, dim)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.core import heads, ops, rng
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import OptimizerConfig, OptState, config_from_kwargs, opt_initial
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm
from fedheads.core.train import local_train
from fedheads.core.tree import tree_cat_chunks, tree_map

_NEG = -1e9  # finite "minus infinity" keeps logsumexp gradients NaN-free for masked entries
# One client_update call trains at most as many clients as keep its [clients, B, sets, C] logits
# of Eq. 9 under this many bytes: those logits grow with the federation (one set per client), and
# at 1,000 clients a 64-client bucket's took 82 MB per step (benchmarks/bench_scale.py).
CALL_LOGIT_BYTES = 32 << 20


@dataclass(frozen=True)
class FedPCLConfig:
    """FedPCL hyper-parameters; defaults from Sec. 5.1 / Appendix A of the paper (Adam lr 1e-3,
    weight decay 1e-4, batch 32, E = 1, tau 0.07; the paper's grid, App. A.1.4: lr {0.1, 0.01,
    0.001, 0.0001}, weight decay {1e-3 ... 1e-5}). Fields left at None / "" take the value of
    the chosen `variant` (see the module docstring)."""

    hidden: int = setting(256, "projection width (Table 7: FC(K*d, 256))", source="FedPCL Table 7")
    tau: float = setting(0.07, "temperature of Eq. 8/9", source="FedPCL Eq. 8/9")
    optimizer: OptimizerConfig = setting(doc="Adam lr 1e-3, wd 1e-4", default_factory=OptimizerConfig, source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "local mini-batch size")
    local_epochs: int = setting(1, "E")
    variant: str = setting("paper", "\"paper\" (Eq. 8-10) or \"code\" (authors' SupCon-style loss)", source="FedPCL Eq. 8-10")
    aggregation: str = setting("", '"weighted" | "eq6_literal" | "mean"; "" = weighted (paper) / mean (code)')
    inference: str = setting("", '"dot" | "sqdist"; "" = dot (paper) / sqdist (code)')
    code_views: int = setting(2, "views per sample in the code variant (stored augmented views if loaded, else copies)")
    binarize_features: bool = setting(False, "x -> sign(x), the code's L2-norm over a size-1 axis")
    noise: str = setting("none", 'noise on uploaded prototypes: "none" | "laplace" | "gaussian" (Table 15)',
                         source="FedPCL Table 15")
    noise_scale: float = setting(0.05, "s, scale of the noise distribution")
    noise_p: float = setting(0.1, "p, perturbation coefficient: x~ = (1-p) x + e")
    reset_optimizer: bool = setting(True, "fresh Adam state every round (as the authors' code)")
    batch_norm: bool | None = setting(None, "BN(hidden) after the ReLU; None = on (paper, Table 7) / off (code)",
                                      source="FedPCL Table 7")
    drop_last: bool | None = setting(None, "drop each epoch's last partial batch; None = off (paper) / on (code)")
    noisy_inference: bool | None = setting(None, "classify with the noised uploaded prototypes; None = off / on (code)")

    def __post_init__(self) -> None:
        checks = [("variant", self.variant, ("paper", "code")),
                  ("aggregation", self.aggregation, ("", "weighted", "eq6_literal", "mean")),
                  ("inference", self.inference, ("", "dot", "sqdist")),
                  ("noise", self.noise, ("none", "laplace", "gaussian"))]
        for name, val, ok in checks:
            if val not in ok:
                raise UserError(f"{name} {val!r}: must be one of {', '.join(repr(o) for o in ok)}")
        if self.tau <= 0 or self.batch_size < 1 or self.local_epochs < 1 or self.code_views < 1:
            raise UserError("tau/batch_size/local_epochs/code_views: must be positive")
        if not 0.0 <= self.noise_p < 1.0 or self.noise_scale < 0:
            raise UserError(f"noise_p {self.noise_p} / noise_scale {self.noise_scale}: need 0 <= p < 1, s >= 0")

    @property
    def agg(self) -> str:
        return self.aggregation or ("weighted" if self.variant == "paper" else "mean")

    @property
    def rule(self) -> str:
        return self.inference or ("dot" if self.variant == "paper" else "sqdist")

    @property
    def bn(self) -> bool:
        return self.variant == "paper" if self.batch_norm is None else bool(self.batch_norm)

    @property
    def drops_last(self) -> bool:
        return self.variant == "code" if self.drop_last is None else bool(self.drop_last)

    @property
    def infers_noisy(self) -> bool:
        return self.variant == "code" if self.noisy_inference is None else bool(self.noisy_inference)


@dataclass(frozen=True)
class FedPCLClientState:
    params: Params  # [M, ...] projection network theta_i
    buffers: Params  # [M, ...] BN running statistics
    opt: OptState  # Adam state (only the step counter when reset every round)
    protos: torch.Tensor  # [M, C, d] local prototypes C_i (Eq. 5) for inference: noise-free unless noisy_inference
    present: torch.Tensor  # [M, C] bool: client holds class j


@dataclass(frozen=True)
class FedPCLServerState:
    bank: torch.Tensor  # [M_all, C, d] latest uploaded local set of every client
    bank_present: torch.Tensor  # [M_all, C] bool
    seen: torch.Tensor  # [M_all] bool: client has uploaded at least once
    global_protos: torch.Tensor  # [C, d] Eq. 6
    global_present: torch.Tensor  # [C] bool


@dataclass(frozen=True)
class FedPCLBroadcast:
    collect_only: bool  # round 0: no training, only upload prototypes
    local_sets: torch.Tensor  # [M_all, C, d] padded local sets (Eq. 7)
    set_valid: torch.Tensor  # [M_all] bool: rows actually sent (clients seen so far)
    set_present: torch.Tensor  # [M_all, C] bool: class j exists in padded set i (own or global)
    global_protos: torch.Tensor  # [C, d]
    global_present: torch.Tensor  # [C] bool

    def comm_size(self) -> tuple[int, int]:
        """Only the valid sets and the global set travel (nothing in the collection round)."""
        if self.collect_only:
            return 0, 0
        C, d = self.global_protos.shape
        m = int(self.set_valid.sum())
        vals = (m + 1) * C * d
        return vals + (m + 1) * C, vals * self.global_protos.element_size() + (m + 1) * C  # + presence bools


@dataclass(frozen=True)
class FedPCLMessage:
    protos: torch.Tensor  # [M, C, d] local prototypes as uploaded (noise added if configured)
    counts: torch.Tensor  # [M, C] float32 |D_ij| (weights of Eq. 6)
    present: torch.Tensor  # [M, C] bool


def contrast_terms(z: torch.Tensor, protos: torch.Tensor, avail: torch.Tensor, y: torch.Tensor,
                   tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-log( exp(z.P_y/tau) / sum_{a in A(y)} exp(z.P_a/tau) ), A(y) = available classes != y.

    z [M,B,d], protos [S,C,d] (S prototype sets shared by all clients, e.g. the broadcast) or
    [M,S,C,d]; avail [S,C] or [M,S,C] bool -> (terms [M,B,S], ok [M,B,S] bool: the positive is
    available and A(y) is not empty)."""
    return ops.proto_contrast(z, protos, avail, y, tau)  # fused forward/backward, tests/test_core_ops.py


def code_supcon(z: torch.Tensor, anchors: torch.Tensor, y: torch.Tensor, valid: torch.Tensor,
                tau: float, views: int) -> torch.Tensor:
    """Authors' ConLoss (temperature = base_temperature) for one prototype set per client.

    z [M,B,d] batch features (repeated V times here: identical cached views) or [M,V*B,d] (V
    stored augmented views, view-major); anchors [M,B,d] = that set's prototype of each sample's
    label. Anchor row i is excluded from contrast column i (the code's self-contrast mask).
    Returns [M]: mean over valid anchors that have a positive (the code divides by 0 otherwise)."""
    M, B, _ = anchors.shape
    f = z if z.shape[1] == views * B and views > 1 else z.repeat(1, views, 1)  # [M,VB,d]
    a = anchors.repeat(1, views, 1)
    yy, vv = y.repeat(1, views), valid.repeat(1, views)
    logits = torch.bmm(a, f.transpose(1, 2)) / tau  # [M,VB,VB]
    eye = torch.eye(B * views, dtype=torch.bool, device=z.device).unsqueeze(0)
    col_ok = vv.unsqueeze(1) & ~eye
    log_den = torch.logsumexp(logits.masked_fill(~col_ok, _NEG), dim=-1, keepdim=True)
    pos = (yy.unsqueeze(2) == yy.unsqueeze(1)) & col_ok
    npos = pos.sum(-1)
    mean_lp = ((logits - log_den) * pos).sum(-1) / npos.clamp_min(1)
    use = vv & (npos > 0)
    return -(mean_lp * use).sum(-1) / use.sum(-1).clamp_min(1)


class FedPCL(AlgorithmBase):
    """Federated Prototype-wise Contrastive Learning (paper or authors'-code variant)."""

    name = "fedpcl"
    collect_rounds = 1  # round 0 only uploads prototypes (Algorithm 1 line 1): R rounds train R-1
    server_client_fields = ("bank", "bank_present", "seen")  # one row per client (core/protocol.py)

    def __init__(self, cfg: FedPCLConfig = FedPCLConfig()) -> None:
        self.cfg = cfg

    def _spec(self, params: Params) -> HeadSpec:
        """The head's shape, read from its parameters (the state carries the run's dimensions)."""
        return HeadSpec(int(params["proj.weight"].shape[-2]), self.cfg.hidden, 0, batch_norm=self.cfg.bn, normalize=True)

    def _x(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x) if self.cfg.binarize_features else x

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, 0, batch_norm=self.cfg.bn, normalize=True)
        M, C, d, dev = spec.num_clients, spec.num_classes, self.cfg.hidden, spec.device
        # each client owns its projection network: independent seeded initialisations
        p, b = heads.init_head(head, heads.client_seeds(spec, seed), dev)
        cs = FedPCLClientState(p, b, opt_initial(self.cfg.optimizer, p, self.cfg.reset_optimizer),
                               torch.zeros(M, C, d, device=dev), torch.zeros(M, C, dtype=torch.bool, device=dev))
        ss = FedPCLServerState(torch.zeros(M, C, d, device=dev), torch.zeros(M, C, dtype=torch.bool, device=dev),
                               torch.zeros(M, dtype=torch.bool, device=dev), torch.zeros(C, d, device=dev),
                               torch.zeros(C, dtype=torch.bool, device=dev))
        return Init(cs, ss, self._broadcast(ss, collect_only=True))

    @staticmethod
    def _broadcast(ss: FedPCLServerState, collect_only: bool) -> FedPCLBroadcast:
        # Eq. 7: a client's set lacking class j is padded with the global prototype of j
        sets = torch.where(ss.bank_present.unsqueeze(-1), ss.bank, ss.global_protos.unsqueeze(0))
        avail = (ss.bank_present | ss.global_present.unsqueeze(0)) & ss.seen.unsqueeze(-1)
        return FedPCLBroadcast(collect_only, sets, ss.seen.clone(), avail, ss.global_protos, ss.global_present)

    def _train_data(self, data: FedData) -> FedData:
        """Code variant with stored augmented views: train on V views placed side by side in x."""
        if self.cfg.variant != "code" or data.v_train is None:
            return data
        V = self.cfg.code_views
        if data.v_train.shape[1] < V:
            raise UserError(f"code_views {V}: the store holds only {data.v_train.shape[1]} views")
        M, _, N, D = data.v_train.shape
        return dataclasses.replace(data, x_train=data.v_train[:, :V].permute(0, 2, 1, 3).reshape(M, N, V * D))

    def _loss_fn(self, bc: FedPCLBroadcast, spec: HeadSpec):
        cfg = self.cfg
        set_avail = bc.set_present
        set_w = bc.set_valid.to(torch.float64) / bc.set_valid.sum().clamp_min(1)  # Eq. 9: (1/m) sum_p (in z's dtype there)

        def paper(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, self._x(x), m, train=True)
            l_g, _ = contrast_terms(z, bc.global_protos.unsqueeze(0), bc.global_present.unsqueeze(0), y, cfg.tau)  # Eq. 8
            # Eq. 10 = mean over the batch's valid rows of (Eq. 8 + Eq. 9); Eq. 9's part is summed
            # directly with those weights (ops.proto_contrast_sum: no [M,B,S] terms are kept)
            row_w = m.to(z.dtype) / m.sum(-1, keepdim=True).clamp_min(1).to(z.dtype)
            l_p = ops.proto_contrast_sum(z, bc.local_sets, set_avail, y, cfg.tau, row_w, set_w)  # Eq. 9
            return ops.masked_mean(l_g[..., 0], m) + l_p, nb  # Eq. 10

        def code(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            V = cfg.code_views
            if x.shape[-1] != spec.in_dim:  # stored views side by side: [M,B,V*D] -> [M,V*B,D]
                M, B = x.shape[:2]
                x = x.view(M, B, V, spec.in_dim).transpose(1, 2).reshape(M, V * B, spec.in_dim)
                z, nb = heads.embed(spec, p, b, self._x(x), m.repeat(1, V), train=True)
            else:
                z, nb = heads.embed(spec, p, b, self._x(x), m, train=True)
            if bc.collect_only:  # round 0 of the code: loss = 0 * CE, so Adam steps on weight decay alone
                return z.sum((1, 2)) * 0.0, nb
            total = torch.zeros(z.shape[0], device=z.device)
            for s in range(bc.local_sets.shape[0]):  # sum over the clients' padded sets
                anchors = bc.local_sets[s][y]  # [M,B,d]
                total = total + bc.set_valid[s] * code_supcon(z, anchors, y, m, cfg.tau, cfg.code_views)
            return total, nb

        return paper if cfg.variant == "paper" else code

    def client_update(self, cs: FedPCLClientState, bc: FedPCLBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedPCLClientState, FedPCLMessage]:
        """Clients in groups whose Eq. 9 logits stay under CALL_LOGIT_BYTES (every client's update
        depends only on its own rows and the broadcast, so the grouping changes no result)."""
        S, C = bc.local_sets.shape[:2]
        views = self.cfg.code_views if self.cfg.variant == "code" else 1
        per_client = self.cfg.batch_size * views * S * C * bc.local_sets.element_size()
        k = max(1, CALL_LOGIT_BYTES // max(per_client, 1))
        M = data.num_clients
        if bc.collect_only or M <= k:
            return self._client_update(cs, bc, data, ctx)
        parts = ((a, self._client_update(tree_map(lambda t: t[a:a + k], cs), bc,  # noqa: B023 (used at once)
                                         data.client_range(a, min(a + k, M)), ctx)) for a in range(0, M, k))
        return tree_cat_chunks(parts, M)  # (state, message) of one group at a time, no list of all

    def _client_update(self, cs: FedPCLClientState, bc: FedPCLBroadcast, data: FedData,
                       ctx: RoundCtx) -> tuple[FedPCLClientState, FedPCLMessage]:
        cfg = self.cfg
        p, b, opt = cs.params, cs.buffers, cs.opt
        spec = self._spec(p)
        if not bc.collect_only or cfg.variant == "code":  # the code also "trains" in round 0 (docstring)
            p, b, opt = local_train(p, b, None if cfg.reset_optimizer else opt, cfg.optimizer, self._loss_fn(bc, spec),
                                    self._train_data(data), ctx,
                                    cfg.batch_size, cfg.local_epochs, drop_last=cfg.drops_last,
                                    keep_opt=not cfg.reset_optimizer, rowwise=True)
        with torch.no_grad():  # Eq. 5 over the full training set, eval mode (in row chunks)
            sums, counts = heads.embedding_class_sums(spec, p, b, data.x_train, data.y_train, data.m_train,
                                                      data.num_classes, self._x)
            protos = sums / counts.clamp_min(1).unsqueeze(-1)
            present = counts > 0
            sent = self._noisy(protos, present, data, ctx)
        kept = sent if cfg.infers_noisy else protos  # the authors' code classifies with the noised set
        return (FedPCLClientState(p, b, cs.opt if cfg.reset_optimizer else opt, kept, present),
                FedPCLMessage(sent, counts.to(torch.float32), present))

    def _noisy(self, protos: torch.Tensor, present: torch.Tensor, data: FedData, ctx: RoundCtx) -> torch.Tensor:
        cfg = self.cfg
        if cfg.noise == "none":
            return protos
        M, C, d = protos.shape
        coords = (ctx.seed, ctx.round, data.client_index.view(M, 1, 1).cpu(),
                  torch.arange(C).view(1, C, 1), torch.arange(d).view(1, 1, d))
        e = (rng.laplace(*coords) if cfg.noise == "laplace" else rng.normal(*coords)) * cfg.noise_scale
        noisy = (1 - cfg.noise_p) * protos + e.to(protos.dtype).to(protos.device)
        return torch.where(present.unsqueeze(-1), noisy, protos)

    def server_aggregate(self, ss: FedPCLServerState, msg: FedPCLMessage,
                         ctx: RoundCtx) -> tuple[FedPCLServerState, FedPCLBroadcast]:
        part = ctx.participants.to(ss.bank.device)
        bank, bank_present, seen = ss.bank.clone(), ss.bank_present.clone(), ss.seen.clone()
        bank[part], bank_present[part], seen[part] = msg.protos, msg.present, True
        # Eq. 6 as a sum of client contributions, then a finalize
        agg = self.cfg.agg
        w = msg.present.to(msg.protos.dtype) if agg == "mean" else msg.counts * msg.present
        num = (w.unsqueeze(-1) * msg.protos).sum(0)
        den = w.sum(0)
        glob = num / den.clamp_min(1e-12).unsqueeze(-1)
        if agg == "eq6_literal":
            glob = glob / msg.present.sum(0).clamp_min(1).unsqueeze(-1)
        has = den > 0
        gp = torch.where(has.unsqueeze(-1), glob, ss.global_protos)
        new = FedPCLServerState(bank, bank_present, seen, gp, ss.global_present | has)
        return new, self._broadcast(new, collect_only=False)

    def predict(self, cs: FedPCLClientState, ss: FedPCLServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        z, _ = heads.embed(self._spec(cs.params), cs.params, cs.buffers, self._x(x), mask, train=False)
        dot = torch.bmm(z, cs.protos.transpose(1, 2))
        local_dot = dot.masked_fill(~cs.present.unsqueeze(1), float("-inf"))
        # MSELoss as in the code (mean over dims), without materialising [M,N,C,d]
        sq = (z.pow(2).sum(-1, keepdim=True) - 2 * dot + cs.protos.pow(2).sum(-1).unsqueeze(1)).clamp_min(0) / z.shape[-1]
        local_sq = -sq.masked_fill(~cs.present.unsqueeze(1), 100.0)
        glob = torch.einsum("mnd,cd->mnc", z, ss.global_protos).masked_fill(~ss.global_present, float("-inf"))
        main = local_dot if self.cfg.rule == "dot" else local_sq
        return {"main": main, "local_dot": local_dot, "local_sqdist": local_sq, "global_dot": glob}

    def prototype_view(self, cs: FedPCLClientState, ss: FedPCLServerState, x: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """For faiss batch prediction (fedheads.predict): z(x) and each client's LOCAL prototypes
        (Section 4, prototype-based inference), with the rule `predict` uses for "main": inner
        product ("ip"), or squared distance in the authors'-code variant (argmin of the mean
        squared error is argmin of the squared distance; absent classes are left out)."""
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        z, _ = heads.embed(self._spec(cs.params), cs.params, cs.buffers, self._x(x), mask, train=False)
        return z, cs.protos, cs.present, ("ip" if self.cfg.rule == "dot" else "sqeuclidean")

    def secure_form(self, message: object = None) -> SecureForm:
        """Eq. 6's sum_i |D_ij| C_i^(j) and sum_i |D_ij| are secure sums; the local prototype
        sets still travel in the clear (Eq. 7 sends every client's set to every client), with
        their counts zeroed. Only the count-weighted aggregation is a sum."""
        if self.cfg.agg != "weighted":
            raise UserError(f"secagg: fedpcl aggregation {self.cfg.agg!r} is not a count-weighted sum "
                            "('mean' weights are public, 'eq6_literal' divides by the holders); use 'weighted'")

        def sums(m: FedPCLMessage) -> dict[str, torch.Tensor]:
            w = (m.counts * m.present)[0].double()  # Eq. 6 weights |D_ij| of the classes held
            return {"num": w.unsqueeze(-1) * m.protos[0].double(), "den": w}

        def clear(m: FedPCLMessage) -> FedPCLMessage:
            return FedPCLMessage(m.protos, torch.zeros_like(m.counts), m.present)

        def agg(ss: FedPCLServerState, clear_msgs: FedPCLMessage | None, tot: dict[str, torch.Tensor],
                ctx: RoundCtx) -> tuple[FedPCLServerState, FedPCLBroadcast]:
            assert clear_msgs is not None
            ss, _ = self.server_aggregate(ss, clear_msgs, ctx)  # zero weights: only the bank of local sets
            den = tot["den"].round()
            mean = torch.where(den.unsqueeze(-1) > 0, tot["num"] / den.clamp_min(1).unsqueeze(-1), torch.zeros_like(tot["num"]))
            totals = FedPCLMessage(mean.float()[None], den.float()[None], (den > 0)[None])
            nobody = RoundCtx(ctx.round, ctx.seed, torch.empty(0, dtype=torch.int64), ctx.num_clients)
            return self.server_aggregate(ss, totals, nobody)  # Eq. 6 on the totals, no bank row written

        return SecureForm(sums, ("den",), clear, agg)

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """FedPCL Sec. 4, Eq. 6-7, Algorithm 1: a client uploads its local set, C x d; the server
        sends every client the padded local sets of ALL m clients plus the global set, (m + 1) x
        C x d. Round 0 only collects the initial prototypes, so nothing is downloaded in it."""
        up = arch.num_classes * arch.proj_dim
        return PaperRoundComm(up, (clients + 1) * up, silent_rounds=1)

    def trainable_params(self, cs: FedPCLClientState) -> int:
        return heads.count_params(cs.params)


def _factory(**kw: object) -> FedPCL:
    return FedPCL(config_from_kwargs(FedPCLConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedpcl", _factory,
                   description="FedPCL (Tan et al. NeurIPS 2022), paper Eq. 5-10; variant='code' = authors' code",
                   config=FedPCLConfig)
