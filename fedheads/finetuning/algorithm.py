"""FT: federated fine-tuning of a pre-trained network and its linear head, the second stage
("FineTune") of Legate et al., "Guiding The Last Layer in Federated Learning with Pre-Trained
Models", NeurIPS 2023, Sec. 3.3, and the paper's FT / Random baselines (Sec. 4).

Objective (Eq. 1): min_{w,v} sum_k (n_k / n) L(g(f(w, X_k), v)) over the K clients. Per round,
the participants start from the global model (w, v) broadcast by the server, run E local
epochs of client SGD on the cross-entropy, and send the change of the trainable state with
weight n_k; the server forms the n_k-weighted mean change as a SUM of client contributions
followed by a finalize (so it can run under secure aggregation), then applies a server
optimiser (McMahan et al. 2017 FedAvg; Li et al. 2020 FedProx; Reddi et al. 2021 FedAdam; Hsu et
al. 2019 FedAvgM, server momentum as FLSim's FedAvgWithLR):

    sums:      S = sum_k n_k (theta_k - theta),   N = sum_k n_k
    finalize:  Delta = S / N;  theta <- ServerOpt(theta, Delta)

FedProx adds mu/2 ||theta_k - theta||^2 to each client's loss (Li et al. 2020, Eq. 2). BatchNorm
running statistics (trained with `bn="train"`) move by their plain weighted mean change, as the
head engines' FedAvg baselines do; only parameters go through the server optimiser. FLSim (the
FedNCM authors' library) differs under FedAdam and FedAvgM: its server optimisers step the model's
parameters only, so the global BatchNorm buffers never move from the pre-trained ones;
`server_buffers="flsim"` does that (under fedadam/fedavgm only; the default "average" keeps the mean
change under every server optimiser).

The starting head (stage 1, HeadTune) comes from the feature store (fedheads.finetuning.heads):
FedNCM (Sec. 3.2: l_c/||l_c||, bias 0), K rounds of LP (App. C.2, Table 6) or a random head (FT).

Defaults (FTConfig): client SGD as in FLSim, the paper's library (momentum 0, weight decay 0);
batch 32 and E = 1 (Sec. 4: "1 local epoch per round"); client lr 0.1, the top of the FedAvg
grid of App. B {0.1, 0.07, ..., 0.001}: on Office-Caltech-10 (feature shift, 10 training images
per class, 4 clients) with resnet20-cifar10, 10 rounds of FT from a random head reach 54.4 / 41.0
/ 29.8 % at lr 0.1 / 0.05 / 0.03 (0.03: cache-first after:layer2) and FedNCM+FT 60.7 / 53.5 /
48.2 % from FedNCM's 44.2 %; at lr 0.01 FT stays below 10 % after 5 rounds (measured on 2 CPU
cores, one seed). As the paper observes for Cars and EuroSAT, FedNCM+FT dips in its first
rounds at this lr before overtaking; `--lr 0.01` is one flag away. The warm-up the paper proposes
for that dip (`warmup_rounds`, off by default) delays it rather than removing it here: with 2
warm-up rounds the mean of 3 seeds is 40.9 / 33.5 % after rounds 1 / 2 (no warm-up: 28.8 / 29.4)
and 58.1 (1.9) % after 10 (no warm-up: 60.3 (1.1)). FedProx mu 0.01; FedAdam server lr 1e-3 (App. B
grid {1e-3 ... 1e-6}).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import DeltaMessage, GlobalModel
from fedheads.algorithms.server_opt import MOMENTUM_SERVERS, SERVER_OPTS, make_server_optimizer
from fedheads.core.config import setting
from fedheads.core.protocol import RoundCtx
from fedheads.finetuning.model import LiveNet, Params
from fedheads.run.checks import check_finite

AMP = ("auto", "off", "bf16", "fp16")


def optimizer_step(opt: torch.optim.Optimizer, scaler: Any, loss: torch.Tensor) -> None:
    """zero_grad, backward, step; through the AMP grad scaler when there is one (CUDA fp16)."""
    opt.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


@dataclass(frozen=True)
class FTConfig:
    """Fine-tuning hyper-parameters (FedNCM paper Sec. 4 and App. B; sources in the module doc)."""

    server: str = setting("fedavg", 'server optimiser: "fedavg" | "fedprox" | "fedadam" | "fedavgm"')
    server_lr: float | None = setting(None, "None: 1.0 for fedavg/fedprox/fedavgm, 1e-3 for fedadam (App. B grid)",
                                      source="FedNCM App. B")
    server_momentum: float = setting(0.9, "FedAvgM's server momentum beta (server=\"fedavgm\" only)")
    server_buffers: str = setting("average", 'BN buffers: mean change always | "flsim": kept under fedadam/fedavgm')
    prox_mu: float = setting(0.01, 'FedProx mu (server="fedprox" only)')
    adam_flavour: str = setting("flsim", "FedAdam: \"flsim\" (torch Adam, the paper's runs) | \"reddi\" (Reddi et al. Alg. 2)",
                                source="Reddi et al. 2021, Alg. 2")
    lr: float = setting(0.1, "client SGD learning rate (top of the App. B FedAvg grid; measured, module doc)",
                        source="FedNCM App. B")
    momentum: float = setting(0.0, "client SGD momentum (FLSim default)")
    weight_decay: float = setting(0.0, "client SGD L2 weight decay (FLSim default)")
    batch_size: int = setting(32, "local mini-batch")
    local_epochs: int = setting(1, "E (Sec. 4)", source="FedNCM Sec. 4")
    amp: str = setting("auto", "CUDA autocast: auto (bf16 where supported, else fp16 + GradScaler) | off | bf16 | fp16 "
                       "(off: float32 weights and activations; convolutions and matmuls still follow torch.backends' "
                       "allow_tf32 flags, PyTorch's default being TF32 convolutions on Ampere and later)")
    warmup_rounds: int = setting(0, "K: client lr rises linearly over the first K FT rounds (0 = off, the paper's runs)")

    def client_lr(self, round_: int) -> float:
        """Client lr of FT round `round_` (0-based): lr (r+1)/(K+1) for r < K, then lr. The warm-up
        the FedNCM paper proposes for FedNCM+FT's first-round dip ("potentially by using an
        initial warm-up period at a lower learning rate", Sec. 4.2); off by default."""
        k = self.warmup_rounds
        return self.lr * (round_ + 1) / (k + 1) if round_ < k else self.lr

    def __post_init__(self) -> None:
        check_finite(self)
        if self.server not in SERVER_OPTS:
            raise UserError(f"server {self.server!r}: use one of {', '.join(SERVER_OPTS)}")
        if self.server_buffers not in ("average", "flsim"):
            raise UserError(f"server_buffers {self.server_buffers!r}: use average or flsim")
        if self.lr <= 0 or self.batch_size < 1 or self.local_epochs < 1:
            raise UserError(f"lr {self.lr} / batch_size {self.batch_size} / local_epochs "
                            f"{self.local_epochs}: must be positive")
        negative = [f"{k} {v}" for k, v in (("momentum", self.momentum),
                    ("weight_decay", self.weight_decay), ("prox_mu", self.prox_mu),
                    ("warmup_rounds", self.warmup_rounds)) if v < 0]
        if negative:
            raise UserError(f"{', '.join(negative)}: must be >= 0")
        if self.amp not in AMP:
            raise UserError(f"amp {self.amp!r}: use one of {', '.join(AMP)}")


@dataclass(frozen=True)
class FTServerState:
    model: GlobalModel  # theta: trainable parameters and BN buffers, no client axis
    opt: Any  # server optimiser state (FedAdam moments; empty for FedAvg/FedProx)


@dataclass(frozen=True)
class DeltaSums:
    """Running sums of client contributions (what secure aggregation would reveal)."""

    delta: Params  # sum_k n_k (theta_k - theta) over parameters
    buffer_delta: Params  # sum_k n_k (b_k - b) over BN buffers
    weight: torch.Tensor  # sum_k n_k (float64 scalar)


def split_state(net: LiveNet) -> GlobalModel:
    """The network's trainable state as (parameters, buffers), cloned."""
    state, pkeys = net.trained_state(), set(net.parameter_keys())
    return GlobalModel({k: v.clone() for k, v in state.items() if k in pkeys},
                       {k: v.clone() for k, v in state.items() if k not in pkeys})


class FineTune:
    """FT under FedAvg / FedProx / FedAdam / FedAvgM; clients run on one workspace network."""

    name = "ft"

    def __init__(self, cfg: FTConfig = FTConfig()) -> None:
        self.cfg = cfg
        self.server_opt = make_server_optimizer(cfg.server, cfg.server_lr, flavour=cfg.adam_flavour,
                                                momentum=cfg.server_momentum)

    personalised = False  # every client is evaluated with the global model

    def init(self, start: GlobalModel) -> FTServerState:
        """Server state from the starting model (pre-trained stages + the stage-1 head)."""
        return FTServerState(start, self.server_opt.init(start.params))

    # What the driver asks of a fine-tuning algorithm besides the client and server steps; the
    # adapter algorithms (fedheads.finetuning.adapters) override them.
    def client_start(self, ss: Any, client: int) -> GlobalModel:
        """The model client `client` starts its round from (and is evaluated with): the broadcast."""
        return ss.model

    eval_model = client_start

    def client_keep(self, ss: Any, client: int, net: LiveNet) -> Any:
        """State a client keeps after training (none for FT)."""
        return ss

    def down_size(self, ss: Any) -> tuple[int, int]:
        """(values, bytes) broadcast to one client per round."""
        from fedheads.core.tree import payload_size

        return payload_size(ss.model, per_client=False)

    @staticmethod
    def load(net: LiveNet, model: GlobalModel) -> None:
        net.load_trained_state({**model.params, **model.buffers})

    # ---------------------------------------------------------------- client
    def client_update(self, bc: GlobalModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      n_train: int, ctx: RoundCtx, net: LiveNet, client: int = -1) -> DeltaMessage:
        """E local epochs of client SGD from the broadcast `bc` on `batches` (the client's local
        steps of this round); returns theta_k - theta with weight n_k (client axis of 1).
        `net` is the one workspace network: its trainable state is overwritten."""
        dev = next(iter(bc.params.values())).device
        net.load_trained_state({**bc.params, **bc.buffers})
        net.train_mode()
        local_sgd(self.cfg, net, net.trained_params(), batches, ctx.round, dev)
        now = net.trained_state()
        return DeltaMessage({k: (now[k] - v).unsqueeze(0) for k, v in bc.params.items()},
                            {k: (now[k] - v).unsqueeze(0) for k, v in bc.buffers.items()},
                            torch.tensor([float(n_train)], dtype=torch.float64, device=dev))

    # ---------------------------------------------------------------- server
    def sums_init(self, ss: FTServerState, ctx: RoundCtx | None = None) -> DeltaSums:
        m = ss.model
        return DeltaSums({k: torch.zeros_like(v) for k, v in m.params.items()},
                         {k: torch.zeros_like(v) for k, v in m.buffers.items()},
                         torch.zeros((), dtype=torch.float64, device=next(iter(m.params.values())).device))

    @staticmethod
    def sums_add(sums: DeltaSums, msg: DeltaMessage) -> DeltaSums:
        """sums + sum over the message's client axis of n_k * delta_k (in place, returned)."""
        w = msg.weight
        for acc, part in ((sums.delta, msg.delta), (sums.buffer_delta, msg.buffer_delta)):
            for k, d in part.items():
                acc[k].add_((w.to(d.dtype).view(-1, *([1] * (d.dim() - 1))) * d).sum(0))
        return DeltaSums(sums.delta, sums.buffer_delta, sums.weight + w.sum())

    def server_finalize(self, ss: FTServerState, sums: DeltaSums, ctx: RoundCtx) -> tuple[FTServerState, GlobalModel]:
        """Delta = S / N, then the server optimiser on the parameters; buffers move by their mean
        (or, with server_buffers "flsim" under fedadam/fedavgm, stay: FLSim steps parameters only)."""
        if float(sums.weight) <= 0:
            return ss, ss.model  # no participant trained: nothing changes
        n = sums.weight
        delta = {k: (v / n.to(v.dtype)) for k, v in sums.delta.items()}
        params, opt = self.server_opt.step(ss.model.params, delta, ss.opt)
        if self.cfg.server_buffers == "flsim" and self.cfg.server in MOMENTUM_SERVERS:
            buffers = dict(ss.model.buffers)
        else:
            buffers = {k: ss.model.buffers[k] + v / n.to(v.dtype) for k, v in sums.buffer_delta.items()}
        model = GlobalModel(params, buffers)
        return FTServerState(model, opt), model

    def server_aggregate(self, ss: FTServerState, msg: DeltaMessage, ctx: RoundCtx) -> tuple[FTServerState, GlobalModel]:
        """The head engines' form: all participants' stacked messages at once."""
        return self.server_finalize(ss, self.sums_add(self.sums_init(ss), msg), ctx)


def local_sgd(cfg: FTConfig, net: LiveNet, params: list[torch.nn.Parameter],
              batches: Iterable[tuple[torch.Tensor, torch.Tensor]], round_: int, device: torch.device) -> None:
    """The client's local steps on `params` (in place): SGD on the cross-entropy of `net`, plus
    FedProx's mu/2 ||theta_k - theta||^2 (Li et al. 2020, Eq. 2) under server="fedprox"."""
    opt = torch.optim.SGD(params, lr=cfg.client_lr(round_), momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    mu = cfg.prox_mu if cfg.server == "fedprox" else 0.0
    anchor = [p.detach().clone() for p in params] if mu else []
    autocast, scaler = _amp(cfg.amp, device)
    for x, y in batches:
        with autocast():
            loss = F.cross_entropy(net(x), y)
        if mu:
            loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
        optimizer_step(opt, scaler, loss)


def _amp(mode: str, device: torch.device):
    """(autocast context factory, GradScaler or None): CUDA only; CPU trains in float32."""
    if device.type != "cuda" or mode == "off":
        return contextlib.nullcontext, None
    bf16 = mode == "bf16" or (mode == "auto" and torch.cuda.is_bf16_supported())
    dtype = torch.bfloat16 if bf16 else torch.float16
    scaler = None if bf16 else torch.amp.GradScaler("cuda")
    return (lambda: torch.autocast(device_type="cuda", dtype=dtype)), scaler
