"""pFedMe (Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, Algorithm 1) on the baselines' head of FedPCL (NeurIPS 2022, Table 7:
FC(K*d, 256)-ReLU-BN(256), then FC(256, C)).

Each participant starts the round from the global model, w_i = theta_i = w, and for every
local mini-batch D (E epochs of batches, i.e. R = E * ceil(n_i / B) local rounds):
  - personalised model: K gradient steps on  f_i(theta; D) + lambda/2 ||theta - w_i||^2  (Eq. 7,
    solved approximately as in Alg. 1 line 7):  theta <- theta - plr (grad f_i(theta; D) + lambda (theta - w_i))
  - local model:  w_i <- w_i - eta lambda (w_i - theta_i)  (Alg. 1 line 8, Eq. 8's gradient)
and sends w_i - w with weight n_i. The server (Alg. 1 line 11):
  w <- (1 - beta) w + beta sum_i n_i w_i / sum_i n_i  =  w + beta * sum_i n_i (w_i - w) / sum_i n_i
(the authors' code weights by training samples; BN running statistics are averaged with beta = 1).

Decisions, stated explicitly:
- Defaults from the paper's MNIST setting (Sec. 5 / the authors' runs): lambda = 15, K = 5,
  personal learning rate 0.1, eta = 0.005, beta = 1 (beta = 2 is the accelerated variant; beta = 1
  is the one the paper uses for comparison with FedAvg). Batch size and epochs follow FedPCL's
  setting for all baselines (B = 32, E = 1) instead of pFedMe's R = 20 batches of 20.
- theta is warm-started across the round's batches (the authors' code keeps it in the model);
  BN runs in train mode in the inner steps and its running statistics are personal to theta.
- No L2 normalisation before the classifier by default (Table 7 as printed; the other baselines
  follow the core's FedAvg head, which normalises). With unit-length z the logits are bounded by
  ||w_c|| and pFedMe's plain gradient steps at the paper's step sizes (eta * lambda < 1 for
  stability) barely move them: on a synthetic 5-client, 10-class, d = 512 federation it stayed at
  chance (12.7%) for 40 rounds, against 25% after 10 rounds without it. ``normalize=True`` is kept.
- Only participants train (the authors' code trains every client but aggregates the selected).
- Inference "main": the personalised theta_i (Sec. 5 "pFedMe (PM)"); "global_model": w."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import (
    DeltaMessage,
    GlobalModel,
    apply_mean_delta,
    config_from_kwargs,
    delta_message,
    expand,
    expand_view,
    grads,
    in_data_order,
    order_by_steps,
    personal_and_global_scores,
    prefix_len,
    rows,
    schedule,
    step_batch,
    step_buffers,
)
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import id_runs
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx


@dataclass(frozen=True)
class PFedMeConfig:
    """pFedMe hyper-parameters (paper defaults; batching as FedPCL Sec. 5.1)."""

    hidden: int = setting(256, "projection width (FedPCL Table 7)", source="FedPCL Table 7")
    normalize: bool = setting(False, "L2-normalise the projection output (off: Table 7 as printed, see docstring)",
                              source="FedPCL Table 7")
    lam: float = setting(15.0, "lambda, strength of the Moreau-envelope proximal term")
    K: int = setting(5, "inner steps per mini-batch for the personalised model theta")
    personal_lr: float = setting(0.1, "step size of the inner steps on theta")
    lr: float = setting(0.005, "eta, step size of the local model update w_i")
    beta: float = setting(1.0, "server mixing: w <- (1 - beta) w + beta * mean(w_i)")
    batch_size: int = setting(32, "local mini-batch size (FedPCL Sec. 5.1)", source="FedPCL Sec. 5.1")
    local_epochs: int = setting(1, "E; local rounds R = E * ceil(n_i / batch_size)")

    def __post_init__(self) -> None:
        if min(self.hidden, self.K, self.batch_size, self.local_epochs) < 1:
            raise UserError(f"hidden/K/batch_size/local_epochs ({self.hidden}, {self.K}, {self.batch_size}, "
                            f"{self.local_epochs}): must be >= 1")
        if self.lam < 0 or self.personal_lr <= 0 or self.lr <= 0 or self.beta <= 0:
            raise UserError(f"lam {self.lam} / personal_lr {self.personal_lr} / lr {self.lr} / beta {self.beta}: "
                            "need lam >= 0 and positive step sizes")


@dataclass(frozen=True)
class PFedMeClientState:
    theta: Params  # [M, ...] personalised model theta_i (after the client's last inner solve)
    buffers: Params  # [M, ...] BN running statistics of theta_i


class PFedMe(AlgorithmBase):
    """pFedMe: bi-level personalisation with Moreau envelopes."""

    name = "pfedme"
    global_rule = "global_model"  # predict's key for the server model alone

    def __init__(self, cfg: PFedMeConfig = PFedMeConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, spec.num_classes, True, self.cfg.normalize)
        g, b = heads.init_global(head, seed, spec.device)
        M = spec.num_clients
        return Init(PFedMeClientState(expand(g, M), expand(b, M)), GlobalModel(g, b), GlobalModel(g, b))

    def client_update(self, cs: PFedMeClientState, bc: GlobalModel, data: FedData,
                      ctx: RoundCtx) -> tuple[PFedMeClientState, DeltaMessage]:
        spec, cfg = heads.spec_of(cs.theta, self.cfg.normalize), self.cfg
        M = data.num_clients
        w0, b0 = expand_view(bc.params, M), expand_view(bc.buffers, M)
        w, theta, buf = expand(bc.params, M), expand(bc.params, M), b0  # updated in place, active clients' rows
        plr, eta_lam, plr_lam = cfg.personal_lr, cfg.lr * cfg.lam, cfg.personal_lr * cfg.lam

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, x, m, train=True)
            return ops.masked_cross_entropy(heads.classify(p, z), y, m), nb

        # clients by step count where that saves work: the ones still stepping are rows [0, k) and a
        # step computes only those (core/train.py). Every client starts from the same w, theta and
        # BN statistics, so nothing needs reordering before the loop, only after it.
        perm, sched = order_by_steps(schedule(data, ctx, cfg.batch_size, cfg.local_epochs))
        with ops.grad_workspace():  # each inner step's gradient in one reused buffer (consumed at once)
            for s in range(sched.num_steps):
                k = prefix_len(sched.ids[s], M)  # the clients stepping are rows [0, k), or k = M
                x, y, valid = step_batch(data, sched, s, k, perm)
                act, runs = sched.active[s], id_runs(sched.ids[s])
                for _ in range(cfg.K):
                    ops.new_step()
                    g, nb, _ = grads(loss_fn, rows(theta, k), rows(buf, k), x, y, valid)
                    for a, b in runs:  # in place, only the rows of clients that have this batch
                        for n in theta:
                            # Alg. 1 line 7: theta <- theta - plr (grad f_i(theta; D) + lambda (theta - w_i)),
                            # computed as lerp(theta, w_i, plr lambda) - plr grad
                            theta[n][a:b].lerp_(w[n][a:b], plr_lam).sub_(g[n][a:b], alpha=plr)
                    buf = step_buffers(act, nb, buf, k < M)
                for a, b in runs:
                    for n in w:
                        # Alg. 1 line 8: w_i <- w_i - eta lambda (w_i - theta_i) = lerp(w_i, theta_i, eta lambda)
                        w[n][a:b].lerp_(theta[n][a:b], eta_lam)
        theta, w, buf = in_data_order(perm, theta, w, buf)
        return PFedMeClientState(theta, buf), delta_message(w, w0, buf, b0, data)

    def server_aggregate(self, ss: GlobalModel, msg: DeltaMessage,
                         ctx: RoundCtx) -> tuple[GlobalModel, GlobalModel]:
        new = apply_mean_delta(ss, msg, self.cfg.beta)  # Alg. 1 line 11: w <- (1-beta) w + beta mean(w_i)
        return new, new

    def predict(self, cs: PFedMeClientState, ss: GlobalModel, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return personal_and_global_scores(heads.spec_of(ss.params, self.cfg.normalize), cs.theta, cs.buffers, ss, x, mask)

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """The whole head each way, as FedAvg (FedPCL Table 2)."""
        up = arch.in_dim * arch.proj_dim + arch.proj_dim * arch.num_classes
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: PFedMeClientState) -> int:
        return heads.count_params(cs.theta)


def _factory(**kw: object) -> PFedMe:
    return PFedMe(config_from_kwargs(PFedMeConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("pfedme", _factory, description="pFedMe (Dinh et al. 2020): Moreau-envelope personalised heads",
                   config=PFedMeConfig)
