"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017, Algorithm 1) on a head over cached features.

Clients start from the global head theta, run E local epochs and send Delta_i = theta_i - theta
with weight n_i; the server forms Delta = sum_i n_i Delta_i / sum_i n_i (a sum of client
contributions, then a finalize) and applies a pluggable server optimiser (core/server_opt.py):
FedAvg is server SGD with lr 1, theta <- theta + Delta. BatchNorm running statistics are
averaged the same way. `proximal_mu` > 0 adds the FedProx term mu/2 ||theta_i - theta||^2
(Li et al., MLSys 2020, Eq. 2) to the client loss.

Inference: "main" = the global model on each client's test split (= "global_model");
"local_model" = each participant's model after its last local training, which makes the client
state one head per client of the federation (``local_models=False`` drops it, as LP's setting
does: a client then keeps nothing between rounds, memory follows the round's participants, and
the global model is the same bit for bit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import expand, expand_view, weighted_mean
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import OptimizerConfig, OptState, config_from_kwargs, opt_initial
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx
from fedheads.core.server_opt import ServerOptimizer, ServerSGD
from fedheads.core.train import local_train


@dataclass(frozen=True)
class FedAvgConfig:
    """FedAvg hyper-parameters (FedPCL Sec. 5.1 training setting for all baselines)."""

    hidden: int = setting(256, 'projection width; 0 = linear head on the features ("LP")')
    batch_norm: bool = setting(True, "BN(hidden) in the projection (FedPCL Table 7 head)", source="FedPCL Table 7")
    normalize: bool = setting(True, "L2-normalise the projection output before the classifier")
    optimizer: OptimizerConfig = setting(doc="Adam lr 1e-3, wd 1e-4", default_factory=OptimizerConfig, source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "local mini-batch size B")
    local_epochs: int = setting(1, "E")
    proximal_mu: float = setting(0.0, "FedProx proximal weight mu (0 = plain FedAvg)")
    reset_optimizer: bool = setting(True, "fresh client optimiser state every round (as the papers' code)")
    local_models: bool = setting(True, 'keep every client\'s last local model for the "local_model" rule (one head per '
                                 'client of the federation); False: a client keeps no model between rounds, so memory '
                                 'follows the round\'s participants and only "main" = "global_model" is evaluated')


@dataclass(frozen=True)
class FedAvgClientState:
    params: Params  # [M, ...] each client's model after its last local training ({} with local_models=False)
    buffers: Params  # [M, ...] BN running statistics of that model ({} with local_models=False)
    opt: OptState  # client optimiser state (only the step counter when reset every round)
    trains: int = 0  # values each client trains, for trainable_params where `params` is {} (else 0)


@dataclass(frozen=True)
class FedAvgServerState:
    params: Params  # global model theta (no client axis)
    buffers: Params  # global BN running statistics
    opt: object  # server optimiser state


@dataclass(frozen=True)
class FedAvgBroadcast:
    params: Params  # global model theta
    buffers: Params  # global BN running statistics


@dataclass(frozen=True)
class FedAvgMessage:
    delta: Params  # [M, ...] theta_i - theta
    buffer_delta: Params  # [M, ...] BN running-stat change
    weight: torch.Tensor  # [M] n_i


class FedAvg(AlgorithmBase):
    """FedAvg / FedProx with a pluggable server optimiser."""

    name = "fedavg"
    global_rule = "global_model"  # predict's key for the server model alone
    update_replaces = ("params", "buffers")  # local training starts from the broadcast theta

    def __init__(self, cfg: FedAvgConfig = FedAvgConfig(), server_opt: ServerOptimizer | None = None,
                 name: str | None = None) -> None:
        if cfg.batch_size < 1 or cfg.local_epochs < 1:
            raise UserError(f"batch_size {cfg.batch_size} / local_epochs {cfg.local_epochs}: must be >= 1")
        if cfg.proximal_mu < 0:
            raise UserError(f"proximal_mu {cfg.proximal_mu}: must be >= 0")
        if not isinstance(cfg.local_models, bool):
            raise UserError(f"local_models {cfg.local_models!r}: must be true or false")
        self.cfg = cfg
        self.server_opt: ServerOptimizer = server_opt if server_opt is not None else ServerSGD(lr=1.0)
        if name is not None:
            self.name = name

    def _spec(self, spec: DataSpec) -> HeadSpec:
        c = self.cfg
        return HeadSpec(spec.dim, c.hidden, spec.num_classes, c.batch_norm and c.hidden > 0, c.normalize)

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = self._spec(spec)
        g, b = heads.init_global(head, seed, spec.device)  # one global init
        M = spec.num_clients
        if self.cfg.local_models:
            cp, cb = expand(g, M), expand(b, M)
            cs = FedAvgClientState(cp, cb, opt_initial(self.cfg.optimizer, cp, self.cfg.reset_optimizer))
        else:  # no model per client: every round starts from the broadcast
            opt = opt_initial(self.cfg.optimizer, expand_view(g, M), self.cfg.reset_optimizer)
            cs = FedAvgClientState({}, {}, opt, heads.count_params(expand_view(g, 1)))
        ss = FedAvgServerState(g, b, self.server_opt.init(g))
        return Init(cs, ss, FedAvgBroadcast(g, b))

    def client_update(self, cs: FedAvgClientState, bc: FedAvgBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedAvgClientState, FedAvgMessage]:
        spec, mu = heads.spec_of(bc.params, self.cfg.normalize), self.cfg.proximal_mu
        M = data.num_clients
        start_p, start_b = expand_view(bc.params, M), expand_view(bc.buffers, M)  # local_train copies once
        reset = self.cfg.reset_optimizer
        opt = None if reset else cs.opt

        anchor = {k: v.unsqueeze(0) for k, v in bc.params.items()}  # w^t, one row for any number of clients

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, x, m, train=True)
            loss = ops.masked_cross_entropy(heads.classify(p, z), y, m)
            if mu:
                sq = sum(((p[k] - anchor[k]) ** 2).flatten(1).sum(1) for k in p)
                loss = loss + 0.5 * mu * sq
            return loss, nb

        # a per-round reset discards the moments: local_train keeps them in reused scratch buffers
        p, b, opt = local_train(start_p, start_b, opt, self.cfg.optimizer, loss_fn, data, ctx,
                                self.cfg.batch_size, self.cfg.local_epochs, keep_opt=not reset, rowwise=True)
        w = torch.tensor(data.n_train, dtype=torch.float32, device=data.device)
        opt = cs.opt if reset else opt
        if not self.cfg.local_models:  # nothing kept: the trained copy becomes Delta_i in place
            msg = FedAvgMessage({k: p[k].sub_(start_p[k]) for k in p}, {k: b[k] - start_b[k] for k in b}, w)
            return FedAvgClientState({}, {}, opt, cs.trains), msg
        msg = FedAvgMessage({k: p[k] - start_p[k] for k in p}, {k: b[k] - start_b[k] for k in b}, w)
        return FedAvgClientState(p, b, opt), msg

    def server_aggregate(self, ss: FedAvgServerState, msg: FedAvgMessage,
                         ctx: RoundCtx) -> tuple[FedAvgServerState, FedAvgBroadcast]:
        # sum_i n_i Delta_i, then the finalize / sum_i n_i (secure-aggregation friendly)
        delta = {k: weighted_mean(v, msg.weight) for k, v in msg.delta.items()}
        params, opt = self.server_opt.step(ss.params, delta, ss.opt)
        buffers = {k: ss.buffers[k] + weighted_mean(v, msg.weight) for k, v in msg.buffer_delta.items()}
        return FedAvgServerState(params, buffers, opt), FedAvgBroadcast(params, buffers)

    def predict(self, cs: FedAvgClientState, ss: FedAvgServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        M = x.shape[0]
        gp, gb = expand_view(ss.params, M), expand_view(ss.buffers, M)
        spec = heads.spec_of(ss.params, self.cfg.normalize)
        zg, _ = heads.embed(spec, gp, gb, x, mask, train=False)
        glob = heads.classify(gp, zg)
        if not cs.params:  # local_models=False: no local model was kept
            return {"main": glob, "global_model": glob}
        zl, _ = heads.embed(spec, cs.params, cs.buffers, x, mask, train=False)
        return {"main": glob, "global_model": glob, "local_model": heads.classify(cs.params, zl)}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """The whole head, projection and classifier, each way (FedPCL Table 2); a linear head
        is C x D weights (FedNCM Appendix A, Eq. 3)."""
        up = (arch.in_dim * arch.proj_dim + arch.proj_dim * arch.num_classes if self.cfg.hidden
              else arch.num_classes * arch.in_dim)
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: FedAvgClientState) -> int:
        return heads.count_params(cs.params) if cs.params else cs.trains


def _factory(**kw: object) -> FedAvg:
    return FedAvg(config_from_kwargs(FedAvgConfig, kw))  # type: ignore[arg-type]


def _lp_factory(**kw: object) -> FedAvg:
    alg = _factory(hidden=0, **kw)
    alg.name = "fedavg-linear"
    return alg


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedavg", _factory, description="FedAvg (McMahan 2017) on the FC-ReLU-BN(256)-L2 + FC head",
                   config=FedAvgConfig)
register_algorithm("fedavg-linear", _lp_factory, description="FedAvg of a linear head on the features",
                   config=FedAvgConfig, fixed={"hidden": "its head is linear (fedavg has the hidden layer)"})
