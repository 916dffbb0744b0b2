"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients",
AAAI 2022, on the FedPCL head (projection FC-ReLU-BN(256)-L2 = z, then a local classifier FC(256, C)).

- Local prototypes: C_i^(j) = mean of z over client i's training samples of class j (FedProto's
  local prototype definition, identical to FedPCL Eq. 5), here over the full training set in eval
  mode after local training.
- Global prototypes, ``aggregation``: "weighted" (default) is the count-weighted mean
  C^(j) = sum_i |D_ij| C_i^(j) / sum_i |D_ij|, the reading of the papers' aggregation formula
  (FedProto's global prototype equation and FedPCL Eq. 6 print it with an extra 1/|N_j|, see
  fedpcl.py); "mean" is what the FedProto and FedPCL authors' code computes (lib/utils.py
  proto_aggregation): the unweighted mean over the clients holding class j. The message carries
  w_ij C_i^(j) and w_ij (w = |D_ij|, or 1 for a held class with "mean"), so the server only
  needs totals (secure-aggregation friendly). With partial participation a class none of this
  round's participants holds keeps its previous prototype.
- Local objective: L = CE(classifier(z), y) + lambda * MSE(z, C^(y)) (FedProto's supervised loss
  plus the prototype regulariser; MSE is the mean over the d dimensions as torch.nn.MSELoss does,
  and a sample whose class has no global prototype yet contributes 0 to the regulariser, which
  is how the authors' code fills it). Round 0 therefore trains with CE only.
- Inference: "main" = the local classifier. The FedPCL paper compares against FedProto (Sec. 5.1,
  Tables 2-3, 11-13) and gives every baseline a projection network followed by a classifier, but
  it does not say which of FedProto's predictions it reports: the classifier is our reading;
  "global_protos" = nearest global prototype by squared L2 (FedProto's prototype inference);
  "local_protos" = nearest local prototype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import OptimizerConfig, OptState, config_from_kwargs, opt_initial
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm
from fedheads.core.train import local_train


@dataclass(frozen=True)
class FedProtoConfig:
    """FedProto hyper-parameters (training setting of FedPCL Sec. 5.1 for all baselines)."""

    hidden: int = setting(256, "projection width (FedPCL Table 7 head)", source="FedPCL Table 7")
    normalize: bool = setting(True, "L2-normalise z as in the FedPCL head")
    lam: float = setting(1.0, "lambda, weight of the prototype regulariser")
    aggregation: str = setting("weighted", "global prototypes: \"weighted\" (by |D_ij|) or \"mean\" (authors' code)")
    optimizer: OptimizerConfig = setting(doc="Adam lr 1e-3, wd 1e-4", default_factory=OptimizerConfig, source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "local mini-batch size")
    local_epochs: int = setting(1, "E")
    reset_optimizer: bool = setting(True, "fresh client optimiser state every round")

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.lam < 0 or self.batch_size < 1 or self.local_epochs < 1:
            raise UserError("hidden/batch_size/local_epochs must be >= 1 and lam >= 0")
        if self.aggregation not in ("weighted", "mean"):
            raise UserError(f"aggregation {self.aggregation!r}: must be 'weighted' or 'mean'")


@dataclass(frozen=True)
class FedProtoClientState:
    params: Params  # [M, ...] projection + classifier
    buffers: Params  # [M, ...] BN running statistics
    opt: OptState  # client optimiser state (only the step counter when reset every round)
    protos: torch.Tensor  # [M, C, d] local prototypes
    present: torch.Tensor  # [M, C] bool


@dataclass(frozen=True)
class FedProtoServerState:
    global_protos: torch.Tensor  # [C, d]
    global_present: torch.Tensor  # [C] bool


@dataclass(frozen=True)
class FedProtoBroadcast:
    global_protos: torch.Tensor  # [C, d]
    global_present: torch.Tensor  # [C] bool


@dataclass(frozen=True)
class FedProtoMessage:
    weighted_protos: torch.Tensor  # [M, C, d] w_ij * C_i^(j)
    weights: torch.Tensor  # [M, C] float32 w_ij: |D_ij| ("weighted") or 1 if held ("mean")


class FedProto(AlgorithmBase):
    """FedProto on cached features."""

    name = "fedproto"

    def __init__(self, cfg: FedProtoConfig = FedProtoConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, spec.num_classes, True, self.cfg.normalize)
        M, C, d, dev = spec.num_clients, spec.num_classes, self.cfg.hidden, spec.device
        p, b = heads.init_head(head, heads.client_seeds(spec, seed), dev)
        cs = FedProtoClientState(p, b, opt_initial(self.cfg.optimizer, p, self.cfg.reset_optimizer),
                                 torch.zeros(M, C, d, device=dev), torch.zeros(M, C, dtype=torch.bool, device=dev))
        ss = FedProtoServerState(torch.zeros(C, d, device=dev), torch.zeros(C, dtype=torch.bool, device=dev))
        return Init(cs, ss, FedProtoBroadcast(ss.global_protos, ss.global_present))

    def client_update(self, cs: FedProtoClientState, bc: FedProtoBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedProtoClientState, FedProtoMessage]:
        spec, cfg = heads.spec_of(cs.params, self.cfg.normalize), self.cfg

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, x, m, train=True)
            ce = ops.masked_cross_entropy(heads.classify(p, z), y, m)
            target = bc.global_protos[y]  # [M,B,d]
            has = bc.global_present[y]
            mse = ((z - target) ** 2).mean(-1) * has
            return ce + cfg.lam * ops.masked_mean(mse, m), nb

        opt = None if cfg.reset_optimizer else cs.opt
        p, b, opt = local_train(cs.params, cs.buffers, opt, cfg.optimizer, loss_fn, data, ctx,
                                cfg.batch_size, cfg.local_epochs, rowwise=True)
        with torch.no_grad():  # in row chunks (heads.embedding_class_sums)
            sums, counts = heads.embedding_class_sums(spec, p, b, data.x_train, data.y_train, data.m_train,
                                                      data.num_classes)
        protos = sums / counts.clamp_min(1).unsqueeze(-1)
        w = counts.to(torch.float32) if cfg.aggregation == "weighted" else (counts > 0).to(torch.float32)
        return (FedProtoClientState(p, b, cs.opt if cfg.reset_optimizer else opt, protos, counts > 0),
                FedProtoMessage(w.unsqueeze(-1) * protos, w))

    def server_aggregate(self, ss: FedProtoServerState, msg: FedProtoMessage,
                         ctx: RoundCtx) -> tuple[FedProtoServerState, FedProtoBroadcast]:
        num, den = msg.weighted_protos.sum(0), msg.weights.sum(0)  # sums of contributions
        has = den > 0
        gp = torch.where(has.unsqueeze(-1), num / den.clamp_min(1e-12).unsqueeze(-1), ss.global_protos)
        new = FedProtoServerState(gp, ss.global_present | has)
        return new, FedProtoBroadcast(new.global_protos, new.global_present)

    def predict(self, cs: FedProtoClientState, ss: FedProtoServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        z, _ = heads.embed(heads.spec_of(cs.params, self.cfg.normalize), cs.params, cs.buffers, x, mask, train=False)
        gd = torch.cdist(z, ss.global_protos.unsqueeze(0).expand(z.shape[0], -1, -1)) ** 2
        ld = torch.cdist(z, cs.protos) ** 2
        return {"main": heads.classify(cs.params, z),
                "global_protos": (-gd).masked_fill(~ss.global_present, float("-inf")),
                "local_protos": (-ld).masked_fill(~cs.present.unsqueeze(1), float("-inf"))}

    def secure_form(self, message: object = None) -> SecureForm:
        """The count-weighted prototypes w_ij C_i^(j) and the weights w_ij are secure sums."""

        def agg(ss: object, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
            msg = FedProtoMessage(tot["weighted_protos"].float()[None], tot["weights"].round().float()[None])
            return self.server_aggregate(ss, msg, ctx)  # type: ignore[arg-type]

        return SecureForm(lambda m: {"weighted_protos": m.weighted_protos[0].double(), "weights": m.weights[0].double()},
                          ("weights",), lambda m: None, agg)

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """One prototype per class, C x d, each way (FedPCL Table 2)."""
        up = arch.num_classes * arch.proj_dim
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: FedProtoClientState) -> int:
        return heads.count_params(cs.params)


def _factory(**kw: object) -> FedProto:
    return FedProto(config_from_kwargs(FedProtoConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedproto", _factory, description="FedProto (Tan et al. AAAI 2022): CE + lambda*MSE to global prototypes",
                   config=FedProtoConfig)
