"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021, Algorithm 1) on the baselines' head of FedPCL (NeurIPS 2022, Table 7).

Model: representation phi = projection FC(K*d, 256)-ReLU-BN(256) (L2-normalised output as in the
core's FedAvg head, ``normalize``), personal head h_i = classifier FC(256, C). Per round, each
participant
  1. receives the global representation phi (FC weight and bias, BN affine and running stats);
  2. updates its own head h_i for ``head_epochs`` epochs with phi fixed (Alg. 1 lines 5-7);
  3. updates phi for ``rep_epochs`` epochs with the new h_i fixed (Alg. 1 lines 8-10);
  4. sends phi_i - phi with weight n_i.
The server sets phi <- phi + sum_i n_i (phi_i - phi) / sum_i n_i (Alg. 1 line 13 averages the
participants' representations; the authors' code weights them by sample counts, as here).

Decisions, stated explicitly:
- head_epochs = 10, rep_epochs = 1: FedRep Sec. 5 trains the head for 10 local epochs and the
  representation for 1 (the authors' code: local_ep - local_rep_ep head epochs, then local_rep_ep).
- What is shared: the whole projection block, so BN's affine parameters and running statistics
  travel with the FC layer. FedPCL Table 2 counts 131,072 = 512 x 256 communicated values for
  FedRep with K = 1, i.e. only the FC weight; the engine logs what is actually sent here
  (512*256 + 256 + 2*256 parameters + 2*256 BN statistics + 1 weight for K = 1).
- Optimiser: FedPCL Sec. 5.1's setting for all baselines (Adam lr 1e-3, wd 1e-4, batch 32), a
  fresh optimiser per phase and round (as the authors' code builds one per local update); BN
  runs in train mode in both phases (torch's model.train() with frozen parameters).
- Inference "main": the global representation with the client's personal head (the authors'
  code loads phi_glob into every local model before testing); "local_model": the client's own
  phi_i after its last local update with its head."""

from __future__ import annotations

import dataclasses
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
    salted,
)
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import OptimizerConfig
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx
from fedheads.core.train import local_train

HEAD_KEYS = ("cls.weight", "cls.bias")


@dataclass(frozen=True)
class FedRepConfig:
    """FedRep hyper-parameters."""

    hidden: int = setting(256, "projection width (FedPCL Table 7)", source="FedPCL Table 7")
    normalize: bool = setting(True, "L2-normalise the representation output")
    optimizer: OptimizerConfig = setting(doc="Adam lr 1e-3, wd 1e-4 (FedPCL Sec. 5.1)", default_factory=OptimizerConfig,
                                         source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "local mini-batch size")
    head_epochs: int = setting(10, "tau_h: local epochs on the personal head, representation fixed (FedRep Sec. 5)",
                               source="FedRep Sec. 5")
    rep_epochs: int = setting(1, "tau_phi: local epochs on the representation, head fixed (FedRep Sec. 5)",
                              source="FedRep Sec. 5")

    def __post_init__(self) -> None:
        if min(self.hidden, self.batch_size, self.head_epochs, self.rep_epochs) < 1:
            raise UserError(f"hidden/batch_size/head_epochs/rep_epochs ({self.hidden}, {self.batch_size}, "
                            f"{self.head_epochs}, {self.rep_epochs}): must be >= 1")


@dataclass(frozen=True)
class FedRepClientState:
    params: Params  # [M, ...] client's phi_i (after its last local update) and personal head h_i
    buffers: Params  # [M, ...] BN running statistics of phi_i


class FedRep(AlgorithmBase):
    """FedRep: shared representation, personal heads."""

    name = "fedrep"

    def __init__(self, cfg: FedRepConfig = FedRepConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, spec.num_classes, True, self.cfg.normalize)
        g, b = heads.init_global(head, seed, spec.device)  # every client starts from one model
        rep = {k: v for k, v in g.items() if k not in HEAD_KEYS}
        M = spec.num_clients
        return Init(FedRepClientState(expand(g, M), expand(b, M)), GlobalModel(rep, b),
                    GlobalModel(rep, b))

    def client_update(self, cs: FedRepClientState, bc: GlobalModel, data: FedData,
                      ctx: RoundCtx) -> tuple[FedRepClientState, DeltaMessage]:
        spec, cfg = heads.spec_of(cs.params, self.cfg.normalize), self.cfg
        M = data.num_clients
        rep0, buf0 = expand_view(bc.params, M), expand_view(bc.buffers, M)  # local_train copies once
        head0 = {k: cs.params[k] for k in HEAD_KEYS}

        def loss_of(rep: Params, head: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, rep, b, x, m, train=True)
            return ops.masked_cross_entropy(heads.classify(head, z), y, m), nb

        # 1. personal head, representation fixed. FC-ReLU does not depend on the batch, so it is
        # computed once for all rows; BN (batch statistics) and L2 still run per mini-batch.
        with torch.no_grad():
            pre = ops.relu(ops.linear(data.x_train, rep0["proj.weight"], rep0["proj.bias"]))
        bn_w, bn_b = bc.params["bn.weight"].unsqueeze(0), bc.params["bn.bias"].unsqueeze(0)  # one row: rowwise

        def head_loss(h: Params, b: Params, a: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, rm, rv = ops.batch_norm(a, m, bn_w, bn_b, b["bn.running_mean"], b["bn.running_var"], train=True)
            z = ops.l2_normalize(z) if spec.normalize else z
            return ops.masked_cross_entropy(heads.classify(h, z), y, m), {"bn.running_mean": rm, "bn.running_var": rv}

        head, buf, _ = local_train(head0, buf0, None, cfg.optimizer, head_loss,
                                   dataclasses.replace(data, x_train=pre), ctx, cfg.batch_size, cfg.head_epochs,
                                   keep_opt=False, rowwise=True)
        # 2. representation, new head fixed (its own batch order; the head's rows go with each step's)
        rep, buf, _ = local_train(rep0, buf, None, cfg.optimizer,
                                  lambda r, b, x, y, m, h: loss_of(r, h, b, x, y, m), data, salted(ctx, 1),
                                  cfg.batch_size, cfg.rep_epochs, keep_opt=False, rowwise=True, consts=head)
        return FedRepClientState({**rep, **head}, buf), delta_message(rep, rep0, buf, buf0, data)

    def server_aggregate(self, ss: GlobalModel, msg: DeltaMessage,
                         ctx: RoundCtx) -> tuple[GlobalModel, GlobalModel]:
        new = apply_mean_delta(ss, msg)
        return new, new

    def predict(self, cs: FedRepClientState, ss: GlobalModel, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        M = x.shape[0]
        spec = heads.spec_of(cs.params, self.cfg.normalize)
        zg, _ = heads.embed(spec, expand_view(ss.params, M), expand_view(ss.buffers, M), x, mask, train=False)
        zl, _ = heads.embed(spec, cs.params, cs.buffers, x, mask, train=False)
        personal = heads.classify(cs.params, zg)
        return {"main": personal, "global_rep": personal, "local_model": heads.classify(cs.params, zl)}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """The shared body only; the classifier stays personal (FedPCL Table 2)."""
        up = arch.in_dim * arch.proj_dim
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: FedRepClientState) -> int:
        return heads.count_params(cs.params)


def _factory(**kw: object) -> FedRep:
    return FedRep(config_from_kwargs(FedRepConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedrep", _factory, description="FedRep (Collins et al. 2021): shared projection, personal classifier heads",
                   config=FedRepConfig)
