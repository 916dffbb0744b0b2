"""LP: federated linear probing on the concatenated cached features (Legate et al., "Guiding The
Last Layer in Federated Learning with Pre-Trained Models", NeurIPS 2023, Sec. 3.1/4 "LP": freeze
the base, train only the linear head with a standard FL optimiser), plus the head-tuning
machinery shared with the three-layer MLP of the same paper's App. C.1 (fedheads/algorithms/mlp.py).

Per round (FedAvg skeleton, McMahan et al. 2017): participants start from the global head w,
run E local epochs of client SGD on the cross-entropy and send w_i - w with weight n_i; the
server forms Delta = sum_i n_i (w_i - w) / sum_i n_i and applies ``server_opt``
(fedheads/algorithms/server_opt.py):
  - "fedavg":  w <- w + Delta;
  - "fedprox": same server; clients minimise f_i(w_i) + mu/2 ||w_i - w||^2 (Li et al. 2020, Eq. 2);
  - "fedadam": server Adam on the pseudo-gradient -Delta, FLSim's torch Adam (the FedNCM paper's
    library, default) or Reddi et al. 2021, Alg. 2 (``adam_flavour``, see server_opt.py).

``init="fedncm"`` (FedNCM+LP, Sec. 3.2-3.3): round 0 is FedNCM's one round (Alg. 1): each
participant sends per-class sums and counts of the features that enter the LAST layer (the raw
features for LP; the second hidden activation of the global initial MLP for MLP), computed with
fedncm.client_stats; the server finalises the exact class means l_c and sets that layer's weight
to l_c/||l_c|| and its bias to 0 (fedncm.linear_head_init; absent classes get zero weights).
Training starts in round 1, so ``rounds`` counts the FedNCM round. With partial participation the
means come from round 0's participants only.

``init`` may also name any registered one-pass head whose state defines a linear classifier
(AlgorithmBase.linear_head: ``"fed3r"``, ``"fedcof"``; Fed3R+LP, FedCOF+LP): round 0 runs that
algorithm, in its default settings, on the last layer's input exactly as FedNCM above, and the
last layer starts as its classifier (weight and bias).

Defaults, chosen to learn in the ~30 rounds a user runs first, from the FedNCM paper's App. B
grids (FedAvg client lr {0.1, 0.07, ..., 0.001}; FedAdam client lr {1, ..., 1e-4} x server lr
{1e-3, ..., 1e-6}): LP = FedAvg with client SGD lr 0.1, the top of the FedAvg grid; the MLP
(mlp.py) = FedAdam (FLSim flavour), server lr 1e-3, client SGD lr 0.01. No weight decay, E = 1
(Sec. 4); batch 32, which the FedNCM paper does not state (its public config, written for a text
task, uses 64): FedPCL Sec. 5.1's value, so every method here shares one batch size. FedProx mu
0.01. Measured, mean (sample std) % client accuracy after 30 rounds over 3 seeds, ResNet-20
(CIFAR-10) features, E = 1, batch 32. "digits": MNIST+USPS label shift, 99 clients of ~6 training
images, Dirichlet 0.1; "office": Office-Caltech-10 feature shift, 4 clients x 10 images per class
(FedPCL 57.1, FedProto 57.2, FedAvg 49.6 there; the SURF features of the issue report are not
available offline); "quick": the quickstart's builtin:digits feature shift, 4 clients:

    method, optimiser                       digits        office        quick
    FedNCM (one round)                      59.8          44.2          -
    LP  FedAvg lr 0.01 (former default)     13.9 (5.5)    29.9 (1.6)    15.2 (1.6)
    LP  FedAvg lr 0.1  (default)            38.2 (1.6)    45.5 (1.3)    27.4 (2.2)
    LP  FedAdam flsim 1e-3, client 0.1      17.6 (1.0)    21.8 (3.7)    -
    MLP FedAvg lr 0.01 (former default)     13.3 (3.0)    28.5 (3.2)    15.9 (1.6)
    MLP FedAvg lr 0.1                       12.7 (2.3)    42.4 (4.1)    22.9 (2.7)
    MLP FedAdam flsim 1e-3, client 0.01     60.6 (0.3)    46.7 (1.8)    32.4 (2.2)   (default)
    MLP FedAdam flsim 1e-3, client 0.1      61.1 (0.3)    43.9 (4.0)    30.9 (2.5)
    MLP FedAdam reddi 1e-3, client 0.1      10.0 (0.0)    -             -

(Off the grid, FedAvg lr 0.3 gives LP 55.2 / 41.5 and MLP 53.2 / 45.0.) The former defaults are
one flag away: ``--set lp.lr=0.01``, ``--set mlp.server_opt=fedavg``. Inference: "main" = the
global model on each client's test split (= "global_model"); "local_model" = the client's model
after its last local training, which makes the client state one head per client of the federation
(``local_models=False`` drops it: clients then keep nothing between rounds but a carried client
optimiser, and memory follows the round's participants)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.fedncm import (
    FedNCMMessage,
    authors_code_bias,
    client_stats,
    finalize_means,
    head_bias,
    linear_head_init,
)
from fedheads.algorithms.pfl_common import DeltaMessage, config_from_kwargs, delta_message, expand, expand_view, mean_delta
from fedheads.algorithms.server_opt import SERVER_OPTS, make_server_optimizer
from fedheads.core import ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import Params, count_params
from fedheads.core.optim import OptimizerConfig, OptState, opt_init, opt_initial
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx
from fedheads.core.train import local_train

INITS = ("random", "fedncm")  # besides the registered one-pass linear heads (fed3r, fedcof)


def linear_head_algorithm(name: str) -> AlgorithmBase:
    """The registered one-pass algorithm `name` whose state defines a linear head (an LP init);
    UserError for any other name."""
    from fedheads.algorithms import create_algorithm, list_algorithms

    heads = sorted(i.name for i in list_algorithms()
                   if type(create_algorithm(i.name)).linear_head is not AlgorithmBase.linear_head)
    alg = create_algorithm(name) if name in heads else None
    if alg is None or not alg.one_pass:
        raise UserError(f"init {name!r}: must be one of {', '.join(['random', *heads])}")
    return alg


@dataclass(frozen=True)
class LPConfig:
    """Head-tuning hyper-parameters (FedNCM paper Sec. 4 and App. B); the defaults and the
    measurements behind them are in the module docstring."""

    hidden: tuple[int, ...] = setting((), "widths of hidden ReLU layers before the linear classifier; () = LP")
    init: str = setting("random", '"random" (nn.Linear init), "fedncm" (round 0 = FedNCM, last layer from class means) '
                        'or a one-pass linear head, "fed3r" | "fedcof" (round 0 = that head, the last layer its classifier)')
    ncm_bias: str = setting("zero", "bias of the FedNCM-initialised layer: \"zero\" (paper) or \"random\" (authors' code)")
    server_opt: str = setting("fedavg", '"fedavg" | "fedprox" | "fedadam" | "fedavgm" (server momentum 0.9)')
    server_lr: float | None = setting(None, "server step size; None = 1.0 (fedavg/fedprox) or 1e-3 (fedadam)")
    prox_mu: float = setting(0.01, 'FedProx mu (used only with server_opt="fedprox")')
    adam_flavour: str = setting("flsim", "FedAdam: \"flsim\" (torch Adam, FedNCM's library) or \"reddi\" (Alg. 2)",
                                source="Reddi et al. 2021, Alg. 2")
    adam_beta1: float = setting(0.9, "FedAdam beta1")
    adam_beta2: float | None = setting(None, "FedAdam beta2; None = 0.999 (flsim) / 0.99 (reddi)")
    adam_tau: float | None = setting(None, "FedAdam eps (flsim, 1e-8) / tau (reddi, 1e-3); None = the flavour's")
    adam_weight_decay: float | None = setting(None, "FedAdam L2 on the server step; None = 1e-5 (flsim) / 0 (reddi)")
    optimizer: OptimizerConfig = setting(doc="client SGD, App. B grid top",
                                         default_factory=lambda: OptimizerConfig("sgd", lr=0.1, weight_decay=0.0),
                                         source="FedNCM App. B")
    batch_size: int = setting(32, "local mini-batch size")
    local_epochs: int = setting(1, "E")
    reset_optimizer: bool = setting(True, "fresh client optimiser every round (FLSim builds one per round)")
    local_models: bool = setting(True, 'keep every client\'s last local head for the "local_model" rule (one head per '
                                 'client of the federation); False: a client keeps no head between rounds, so memory '
                                 'follows the round\'s participants and only "main" = "global_model" is evaluated')

    def __post_init__(self) -> None:
        if self.init not in INITS:
            linear_head_algorithm(self.init)
        if self.server_opt not in SERVER_OPTS:
            raise UserError(f"server_opt {self.server_opt!r}: must be one of {', '.join(SERVER_OPTS)}")
        if self.ncm_bias not in ("zero", "random", "paper", "authors-code"):
            raise UserError(f"ncm_bias {self.ncm_bias!r}: must be 'zero' (paper) or 'random' (authors' code)")
        if any(int(h) < 1 for h in self.hidden) or self.batch_size < 1 or self.local_epochs < 1:
            raise UserError(f"hidden {self.hidden} / batch_size {self.batch_size} / local_epochs "
                            f"{self.local_epochs}: must be >= 1")
        if self.prox_mu < 0:
            raise UserError(f"prox_mu {self.prox_mu}: must be >= 0")
        if not isinstance(self.local_models, bool):
            raise UserError(f"local_models {self.local_models!r}: must be true or false")


def init_mlp(in_dim: int, hidden: tuple[int, ...], num_classes: int, seed: int) -> Params:
    """One head (no client axis): fc{i} for the hidden layers, cls last; weights [Din, Dout],
    U(+-1/sqrt(fan_in)) for weight and bias as torch.nn.Linear, drawn in the same order and way
    as core.heads.init_head (so LP starts exactly where the core's linear FedAvg head does)."""
    gen = torch.Generator().manual_seed(int(seed))
    p: Params = {}
    dims = [in_dim, *hidden, num_classes]
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        name = "cls" if i == len(hidden) else f"fc{i}"
        bound = 1.0 / math.sqrt(a)
        for suffix, shape in (("weight", (a, b)), ("bias", (b,))):
            p[f"{name}.{suffix}"] = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    return p


def penultimate(params: Params, x: torch.Tensor, n_hidden: int) -> torch.Tensor:
    """Input of the last layer [M,B,h]: x itself for LP, else relu(fc) layers."""
    for i in range(n_hidden):
        x = ops.relu(ops.linear(x, params[f"fc{i}.weight"], params[f"fc{i}.bias"]))
    return x


def logits(params: Params, x: torch.Tensor, n_hidden: int) -> torch.Tensor:
    return ops.linear(penultimate(params, x, n_hidden), params["cls.weight"], params["cls.bias"])


@dataclass(frozen=True)
class HeadClientState:
    params: Params  # [M, ...] the client's model after its last local training ({} with local_models=False)
    opt: OptState  # client optimiser state (the step counter alone when it is reset every round and no head is kept)
    trains: int = 0  # values each client trains, for trainable_params where `params` is {} (else 0)


@dataclass(frozen=True)
class HeadServerState:
    params: Params  # global head w
    opt: object  # server optimiser state (FedAdam moments)
    ncm_done: bool  # the FedNCM round has happened (always True with init="random")
    ncm_bias: torch.Tensor | None = None  # [C] authors'-code bias of the FedNCM layer, drawn at init from the run seed
    head: Any = None  # init="fed3r"/"fedcof": that algorithm's server state (its statistics round, then its head)


@dataclass(frozen=True)
class HeadBroadcast:
    params: Params  # global head w
    collect_ncm: bool  # this round is the FedNCM statistics round

    def comm_size(self) -> tuple[int, int]:
        """What a client needs: in the FedNCM round only the hidden layers that compute the last
        layer's input (none for LP, whose clients use the raw features), else the whole head."""
        sent = [v for k, v in self.params.items() if not (self.collect_ncm and k.startswith("cls."))]
        return sum(v.numel() for v in sent), sum(v.numel() * v.element_size() for v in sent)


class HeadTuning(AlgorithmBase):
    """LP / MLP head tuning with FedAvg, FedProx or FedAdam and optional FedNCM initialisation."""

    name = "lp"
    global_rule = "global_model"  # predict's key for the server model alone

    def __init__(self, cfg: LPConfig = LPConfig(), name: str | None = None) -> None:
        self.cfg = cfg
        self.server_opt = make_server_optimizer(cfg.server_opt, cfg.server_lr, cfg.adam_beta1,
                                                cfg.adam_beta2, cfg.adam_tau, cfg.adam_flavour,
                                                cfg.adam_weight_decay)
        if name is not None:
            self.name = name
        self.n_hidden = len(cfg.hidden)
        self.collect_rounds = 0 if cfg.init == "random" else 1  # round 0 = the statistics round of the init head
        # init="fed3r"/"fedcof": the head algorithm that round 0 runs on the last layer's input
        self.head_alg = None if cfg.init in INITS else linear_head_algorithm(cfg.init)

    def init(self, spec: DataSpec, seed: int) -> Init:
        g = {k: v.to(spec.device) for k, v in init_mlp(spec.dim, tuple(self.cfg.hidden), spec.num_classes, seed).items()}
        ncm = self.cfg.init != "random"
        bias = head = None
        if self.cfg.init == "fedncm" and head_bias(self.cfg.ncm_bias) == "authors-code":  # nn.Linear's bias (fedncm.py)
            bias = authors_code_bias(spec.num_classes, g["cls.weight"].shape[0], seed).to(spec.device)
        if self.head_alg is not None:  # the head's server state over the last layer's input
            head = self.head_alg.init(dataclasses.replace(spec, dim=g["cls.weight"].shape[0]), seed).server_state
        ss = HeadServerState(g, self.server_opt.init(g), not ncm, bias, head)
        if self.cfg.local_models:
            cp = expand(g, spec.num_clients)
            cs = HeadClientState(cp, opt_init(self.cfg.optimizer, cp))
        else:  # no head per client: a FedAvg client starts every round from the broadcast
            opt = opt_initial(self.cfg.optimizer, expand_view(g, spec.num_clients), self.cfg.reset_optimizer)
            cs = HeadClientState({}, opt, count_params(expand_view(g, 1)))
        return Init(cs, ss, HeadBroadcast(g, ncm))

    def client_update(self, cs: HeadClientState, bc: HeadBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[HeadClientState, DeltaMessage | FedNCMMessage]:
        cfg, nh = self.cfg, self.n_hidden
        M = data.num_clients
        if bc.collect_ncm:  # FedNCM Alg. 1 lines 7-12 on the last layer's input
            with torch.no_grad():  # read only: views of the broadcast, no copy per client
                h = penultimate(expand_view(bc.params, M), data.x_train, nh)
            if self.head_alg is not None:  # the init head's own client step on that input (its only round)
                hdata = dataclasses.replace(data, x_train=h)
                first = self.head_alg.init(hdata.spec(), ctx.seed)
                return cs, self.head_alg.client_update(first.client_state, first.broadcast, hdata, ctx)[1]
            sums, counts = client_stats(h, data.y_train, data.m_train, data.num_classes)
            return cs, FedNCMMessage(sums, counts)
        mu = cfg.prox_mu if cfg.server_opt == "fedprox" else 0.0
        start = expand_view(bc.params, M)  # w for every participant, read only (local_train trains its own copy)

        anchor = {k: v.unsqueeze(0) for k, v in bc.params.items()}  # one row for any number of clients

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            loss = ops.masked_cross_entropy(logits(p, x, nh), y, m)
            if mu:
                loss = loss + 0.5 * mu * sum(((p[k] - anchor[k]) ** 2).flatten(1).sum(1) for k in p)
            return loss, b

        if cfg.local_models:
            opt = opt_init(cfg.optimizer, start) if cfg.reset_optimizer else cs.opt
            p, _, opt = local_train(start, {}, opt, cfg.optimizer, loss_fn, data, ctx, cfg.batch_size,
                                    cfg.local_epochs, rowwise=True)
            return HeadClientState(p, opt), delta_message(p, start, {}, {}, data)
        # no head kept: a reset optimiser's moments live in local_train's scratch buffers, and the
        # trained copy becomes the message w_i - w in place (one [M, ...] copy per participant)
        reset = cfg.reset_optimizer
        p, _, opt = local_train(start, {}, None if reset else cs.opt, cfg.optimizer, loss_fn, data, ctx,
                                cfg.batch_size, cfg.local_epochs, keep_opt=not reset, rowwise=True)
        w = torch.tensor(data.n_train, dtype=torch.float32, device=data.device)
        return HeadClientState({}, opt, cs.trains), DeltaMessage({k: p[k].sub_(start[k]) for k in start}, {}, w)

    def server_aggregate(self, ss: HeadServerState, msg: Any,
                         ctx: RoundCtx) -> tuple[HeadServerState, HeadBroadcast]:
        if self.head_alg is not None and not isinstance(msg, DeltaMessage):  # the init head's round
            head, _ = self.head_alg.server_aggregate(ss.head, msg, ctx)
            last = self.head_alg.linear_head(head)
            assert last is not None  # linear_head_algorithm checked it defines one
            params = {**ss.params, **{k: v.to(ss.params[k]) for k, v in last.items()}}
            return HeadServerState(params, self.server_opt.init(params), True, ss.ncm_bias, head), HeadBroadcast(params, False)
        if isinstance(msg, FedNCMMessage):  # sums of contributions, then finalize (Alg. 1 line 5)
            means, present = finalize_means(msg.sums.sum(0), msg.counts.sum(0))
            last = linear_head_init(means, present, "paper")
            if ss.ncm_bias is not None:
                last["cls.bias"] = ss.ncm_bias
            params = {**ss.params, **{k: v.to(ss.params[k].device) for k, v in last.items()}}
            new = HeadServerState(params, self.server_opt.init(params), True, ss.ncm_bias)
            return new, HeadBroadcast(params, False)
        delta, _ = mean_delta(msg)
        params, opt = self.server_opt.step(ss.params, delta, ss.opt)
        return HeadServerState(params, opt, True, ss.ncm_bias, ss.head), HeadBroadcast(params, False)

    def predict(self, cs: HeadClientState, ss: HeadServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        glob = logits(expand_view(ss.params, x.shape[0]), x, self.n_hidden)  # one head read by every client
        if not cs.params:  # local_models=False: no local head was kept
            return {"main": glob, "global_model": glob}
        return {"main": glob, "global_model": glob, "local_model": logits(cs.params, x, self.n_hidden)}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm | None:
        """The linear layer's weights, C x D, each way (FedNCM Appendix A, Eq. 3); the MLP has
        no published convention."""
        if self.n_hidden:
            return None
        up = arch.num_classes * arch.in_dim
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: HeadClientState) -> int:
        return count_params(cs.params) if cs.params else cs.trains


def _factory(**kw: object) -> HeadTuning:
    return HeadTuning(config_from_kwargs(LPConfig, kw), name="lp")  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("lp", _factory,
                   description="Linear probe (FedNCM paper) with FedAvg / FedProx / FedAdam, optional FedNCM init",
                   config=LPConfig, fixed={"hidden": "the linear probe has no hidden layer (use mlp)"})
