"""Solo: every client trains its own head on its own data and never communicates (the "Solo"
baseline of FedPCL, Tan et al. NeurIPS 2022, Sec. 5.1: "training independently within each
client"; Tables 2-3 list no communicated parameters for it).

Head: the baselines' head of FedPCL Table 7 / Appendix A.1.3, projection FC(K*d, 256)-ReLU-BN(256)
(L2-normalised like the core's FedAvg head, ``normalize``) then classifier FC(256, C), one
independent initialisation per client. A "round" is E local epochs with the FedPCL Sec. 5.1
setting (Adam lr 1e-3, weight decay 1e-4, batch 32, E = 1). Messages and broadcasts are empty,
so the engine logs 0 values up and down. Inference ("main"): each client's own model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import Empty, config_from_kwargs
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import OptimizerConfig, OptState, opt_init
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx
from fedheads.core.train import local_train


@dataclass(frozen=True)
class SoloConfig:
    """Solo hyper-parameters (FedPCL Sec. 5.1 setting)."""

    hidden: int = setting(256, "projection width (FedPCL Table 7)", source="FedPCL Table 7")
    normalize: bool = setting(True, "L2-normalise the projection output (as the core's FedAvg head)")
    optimizer: OptimizerConfig = setting(doc="Adam lr 1e-3, wd 1e-4", default_factory=OptimizerConfig, source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "local mini-batch size")
    local_epochs: int = setting(1, "E, local epochs per round")
    reset_optimizer: bool = setting(False, "keep Adam state across rounds (nothing else interrupts training)")

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.batch_size < 1 or self.local_epochs < 1:
            raise UserError(f"hidden {self.hidden} / batch_size {self.batch_size} / local_epochs "
                            f"{self.local_epochs}: must be >= 1")


@dataclass(frozen=True)
class SoloClientState:
    params: Params  # [M, ...] each client's own head
    buffers: Params  # [M, ...] its BN running statistics
    opt: OptState  # its optimiser state


class Solo(AlgorithmBase):
    """Local training only."""

    name = "solo"

    def __init__(self, cfg: SoloConfig = SoloConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, spec.num_classes, True, self.cfg.normalize)
        p, b = heads.init_head(head, heads.client_seeds(spec, seed), spec.device)
        return Init(SoloClientState(p, b, opt_init(self.cfg.optimizer, p)), Empty(), Empty())

    def client_update(self, cs: SoloClientState, bc: Empty, data: FedData,
                      ctx: RoundCtx) -> tuple[SoloClientState, Empty]:
        spec, cfg = heads.spec_of(cs.params, self.cfg.normalize), self.cfg

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, x, m, train=True)
            return ops.masked_cross_entropy(heads.classify(p, z), y, m), nb

        opt = opt_init(cfg.optimizer, cs.params) if cfg.reset_optimizer else cs.opt
        p, b, opt = local_train(cs.params, cs.buffers, opt, cfg.optimizer, loss_fn, data, ctx,
                                cfg.batch_size, cfg.local_epochs, rowwise=True)
        return SoloClientState(p, b, opt), Empty()

    def server_aggregate(self, ss: Empty, msg: Empty, ctx: RoundCtx) -> tuple[Empty, Empty]:
        return ss, Empty()

    def predict(self, cs: SoloClientState, ss: Empty, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        z, _ = heads.embed(heads.spec_of(cs.params, self.cfg.normalize), cs.params, cs.buffers, x, mask, train=False)
        return {"main": heads.classify(cs.params, z)}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Nothing is sent (FedPCL Table 2 prints "-")."""
        up = 0
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: SoloClientState) -> int:
        return heads.count_params(cs.params)


def _factory(**kw: object) -> Solo:
    return Solo(config_from_kwargs(SoloConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("solo", _factory, description="Solo: local training only, no communication (FedPCL baseline)",
                   config=SoloConfig)
