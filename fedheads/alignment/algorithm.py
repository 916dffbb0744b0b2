"""FedDRA: federated distributionally robust vision-language alignment.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data
Heterogeneity" (under review at TMLR), Sec. 4 and Algorithms 1-3; every ambiguity is an option
below with the FedDRA notes' reading [R] as default. One round r (Alg. 1, schedule "interleaved"):

  1. the server broadcasts theta^r (encoders), Theta^r (alignment modules) and lambda^r;
  2. stage 1 (Alg. 2): Theta_i <- Theta^r; E steps on L_local w.r.t. Theta only, encoders frozen
     (their token states come from the cache), learning rate s_i * eta;
  3. Theta^{r+1/2} = (1/N) sum_i Theta_i                                          (Alg. 1 line 7)
  4. stage 2 (Alg. 3): (theta_i, Theta_i) <- (theta^r, Theta^{r+1/2}); E steps on everything, live;
  5. theta^{r+1} = (1/N) sum_i theta_i (line 12) and [R] Theta^{r+1} = (1/N) sum_i Theta_i;
  6. v_i = InfoNCE of client i's local model after the round on fixed batches    (lines 13-16)
  7. lambda^{r+1} = Proj_Q(lambda^r exp(gamma v) / sum)                            (line 18, dro.py)

Objective (Sec. 4.1): L_local = L_MI + mu L_C                                        (Eq. 1)
  L_CL(a, b) = (1/B) sum_i -log[exp(cos(a_i, b_i)/tau) / sum_j exp(cos(a_i, b_j)/tau)] (App. D Eq. 4)
  L_MI = 1/2 (L_CL(zx, zy) + L_CL(zy, zx))            [R] both directions, tau = 0.1 (ConVIRT/MGCA)
  L_C = (1/B) sum_b ||zx_b - z*x_b||^2 + ||zy_b - z*y_b||^2   [R] both squared (Prop. 1), on the
        L2-normalised z (Lemma 1); z* from a frozen copy of the global model received at the start
        of the stage, on the same batch, no gradient.
Step scaling (Sec. 4.3: theta_i -= eta lambda_i grad): [R] s_i = N lambda_i^r multiplies the
client's LEARNING RATE (AdamW ignores the scale of the loss), so rho = 0, mu = 0 is FedAvg's update
(with FedDRA's two-stage schedule unless two_stage = False). The paper's update has no weight decay:
the decay we add (AdamW's decoupled lr * wd * w per step, or SGD's L2 term) is NOT scaled by s_i,
so a client's weight loss per step is the same at every lambda and only the gradient step follows s_i.

Aggregation is the unweighted mean of Alg. 1 lines 7/12 (1/N, whatever the clients' sizes), written
as sums of client deltas (weight 1 each) and a finalize: Theta <- Theta + (1/N) sum_i (Theta_i - Theta).
`aggregation = "samples"` weights client i by its training pairs n_i instead (Theta += sum_i n_i
(Theta_i - Theta) / sum_j n_j, FedAvg's weights in McMahan et al. 2017): an option for the baselines,
not Alg. 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import GlobalModel
from fedheads.alignment import dro
from fedheads.alignment.model import DualEncoder, Params, is_module_key
from fedheads.alignment.pairs import PairBatch
from fedheads.core.config import setting
from fedheads.finetuning.algorithm import AMP, _amp, optimizer_step
from fedheads.run.checks import check_finite

SCHEDULES = ("interleaved", "sequential")
AGGREGATIONS = ("uniform", "samples")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class FedDRAConfig:
    """FedDRA hyper-parameters. Paper = FedDRA App. A.1 (MIMIC-CXR main experiments); [R] = the
    FedDRA notes' reading of an ambiguity; CPU = chosen to learn in a short CPU run (measured,
    see docs/contracts.md section 10)."""

    # objective (Sec. 4.1, Eq. 1; App. D Eq. 4)
    mu: float = setting(5.0, "weight of L_C (paper: 5; ophthalmology 1)")
    tau: float = setting(0.1, "InfoNCE temperature ([R]: not given; 0.1 as ConVIRT/MGCA)")
    infonce: str = setting("both", 'L_MI: "both" directions averaged [R] | "image-to-text" (Eq. 4 as printed)',
                           source="FedDRA Eq. 4")
    constraint: str = setting("squared", 'L_C: both terms squared [R] (Prop. 1) | "as-printed" (text term unsquared)')
    constraint_on: str = setting("normalized", 'L_C on L2-normalised z [R] (Lemma 1) | "raw" module outputs')
    # schedule (Sec. 4.2, Alg. 1-3)
    rounds: int = setting(25, "communication rounds R (paper: 25)")
    schedule: str = setting("interleaved", 'Alg. 1 as printed [R] | "sequential": R1 rounds of stage 1, then stage 2',
                            source="FedDRA Alg. 1")
    stage1_rounds: int | None = setting(None, "sequential: R1 (None: half of `rounds`, rounded up)")
    two_stage: bool = setting(True, 'False: stage 2 alone every round (Table 3 ablation "w/o two-stage")',
                              source="FedDRA Table 3")
    aggregate_modules_after_stage2: bool = setting(True, "[R] Theta^{r+1} = mean of stage-2 Theta_i (Alg. 1 l. 12: theta only)",
                                                   source="FedDRA Alg. 1")
    steps: int = setting(50, "E, local steps per stage ([R] per stage; paper: 50 batches per round)")
    batch_size: int = setting(64, "B (paper: 288-388 on 4 A40; CPU: 64 for stage 1)")
    # optimisation (not given by the paper)
    optimizer: str = setting("adamw", "fresh per client and stage, every round (no optimiser state travels)")
    lr: float = setting(1e-3, "alignment modules (CPU; trained from scratch, the paper's 2e-5 is for pre-trained blocks)")
    encoder_lr: float = setting(2e-5, "encoders in stage 2 (paper: 2e-5)")
    weight_decay: float = setting(0.01, "AdamW's decoupled weight decay (torch default)")
    step_scaling: str = setting("n_lambda", 's_i = N lambda_i [R] | "lambda" (literal Sec. 4.3); never scales the decay',
                                source="FedDRA Sec. 4.3")
    aggregation: str = setting("uniform", 'client weights of the server mean: 1/N (Alg. 1 lines 7, 12) | "samples" n_i',
                               source="FedDRA Alg. 1")
    prox_mu: float = setting(0.0, "FedProx proximal term mu/2 ||w - w^r||^2 (Li et al. 2020 Eq. 2), baseline only",
                             source="Li et al. 2020, Eq. 2")
    # DRO (Sec. 4.3, Eq. 2)
    dro: dro.DROConfig = field(default_factory=dro.DROConfig)
    dro_loss: str = setting("infonce", 'v_i: InfoNCE [R] (Sec. 5.1.3) | "local": L_local of Eq. 2',
                            source="FedDRA Sec. 5.1.3; FedDRA Eq. 2")
    dro_model: str = setting("local", "v_i of the client's local model after the round [R] (Alg. 1 l. 15) | \"global\"",
                             source="FedDRA Alg. 1")
    dro_batches: int = setting(4, "fixed batches per client for v_i ([R] same number and size for every client)")
    amp: str = setting("auto", "CUDA autocast: auto | off | bf16 | fp16 (CPU trains in float32; off: see FTConfig.amp)")

    def __post_init__(self) -> None:
        check_finite(self)
        checks = [(self.schedule in SCHEDULES, f"schedule {self.schedule!r}: use {' or '.join(SCHEDULES)}"),
                  (self.infonce in ("both", "image-to-text"), f"infonce {self.infonce!r}: use both or image-to-text"),
                  (self.constraint in ("squared", "as-printed"), f"constraint {self.constraint!r}: use squared or as-printed"),
                  (self.constraint_on in ("normalized", "raw"), f"constraint_on {self.constraint_on!r}: use normalized or raw"),
                  (self.optimizer in OPTIMIZERS, f"optimizer {self.optimizer!r}: use {' or '.join(OPTIMIZERS)}"),
                  (self.step_scaling in ("n_lambda", "lambda"), f"step_scaling {self.step_scaling!r}: use n_lambda or lambda"),
                  (self.aggregation in AGGREGATIONS, f"aggregation {self.aggregation!r}: use {' or '.join(AGGREGATIONS)}"),
                  (self.dro_loss in ("infonce", "local"), f"dro_loss {self.dro_loss!r}: use infonce or local"),
                  (self.dro_model in ("local", "global"), f"dro_model {self.dro_model!r}: use local or global"),
                  (self.amp in AMP, f"amp {self.amp!r}: use one of {', '.join(AMP)}"),
                  (self.rounds >= 1 and self.steps >= 1 and self.batch_size >= 2 and self.dro_batches >= 1,
                   "--rounds, steps, dro_batches must be >= 1 and batch_size >= 2"),
                  (self.mu >= 0 and self.prox_mu >= 0 and self.tau > 0, "mu, prox_mu must be >= 0, tau > 0"),
                  (self.lr > 0 and self.encoder_lr >= 0 and self.weight_decay >= 0,
                   "lr > 0, encoder_lr >= 0, weight_decay >= 0"),
                  (self.stage1_rounds is None or 0 <= self.stage1_rounds <= self.rounds,
                   f"stage1_rounds {self.stage1_rounds}: must be between 0 and --rounds {self.rounds}")]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)

    def plan(self) -> list[tuple[int, ...]]:
        """The stages of each round (Alg. 1 / the sequential reading / no two-stage)."""
        if not self.two_stage:
            return [(2,)] * self.rounds
        if self.schedule == "interleaved":
            return [(1, 2)] * self.rounds
        r1 = math.ceil(self.rounds / 2) if self.stage1_rounds is None else self.stage1_rounds
        return [(1,)] * r1 + [(2,)] * (self.rounds - r1)


@dataclass(frozen=True)
class FDServerState:
    model: GlobalModel  # theta and Theta: every trained parameter and floating buffer, no client axis
    lam: torch.Tensor  # [N] float64 lambda^r (Alg. 1)


@dataclass(frozen=True)
class FDMessage:
    """Client -> server after one stage (client axis of 1): the change of what it trained, its
    aggregation weight (1: Alg. 1's unweighted mean; n_i with aggregation "samples") and v_i (NaN
    when not measured)."""

    delta: Params
    buffer_delta: Params
    weight: torch.Tensor  # [1] float64
    v: torch.Tensor  # [1] float64
    client: torch.Tensor  # [1] int64 global client id


@dataclass(frozen=True)
class FDSums:
    delta: Params  # sum_i (w_i - w)
    buffer_delta: Params
    weight: torch.Tensor  # sum_i 1
    v: torch.Tensor  # [N] float64: v_i scattered by client id (NaN where absent)


# ------------------------------------------------------------------ losses
def info_nce(a: torch.Tensor, b: torch.Tensor, tau: float) -> torch.Tensor:
    """L_CL(a, b) of App. D Eq. 4: rows of a query the rows of b; cosine similarity / tau."""
    logits = F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T / tau
    return F.cross_entropy(logits, torch.arange(a.shape[0], device=a.device))


def l_mi(zx: torch.Tensor, zy: torch.Tensor, cfg: FedDRAConfig) -> torch.Tensor:
    if cfg.infonce == "image-to-text":
        return info_nce(zx, zy, cfg.tau)
    return 0.5 * (info_nce(zx, zy, cfg.tau) + info_nce(zy, zx, cfg.tau))  # [R] symmetric L_MI


def l_c(zx, zy, ax, ay, cfg: FedDRAConfig) -> torch.Tensor:
    """L_C of Sec. 4.1 against the anchor (ax, ay) = the frozen global model's outputs."""
    if cfg.constraint_on == "normalized":
        zx, zy, ax, ay = (F.normalize(t.float(), dim=-1) for t in (zx, zy, ax, ay))
    tx = ((zx.float() - ax.float()) ** 2).sum(-1)
    ty = ((zy.float() - ay.float()) ** 2).sum(-1)
    if cfg.constraint == "as-printed":
        ty = ty.sqrt()
    return (tx + ty).mean()


def _tokens(net: DualEncoder, b: PairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(image tokens, text tokens, text mask) of a batch: its cached states, else the live encoders."""
    img = b.img_tok if b.img_tok is not None else net.image_tokens(b.images)
    if b.txt_tok is not None:
        return img, b.txt_tok, b.txt_mask
    return img, net.text_tokens(b.ids, b.mask), b.mask


# ------------------------------------------------------------------ the algorithm
class FedDRA:
    """Typed state, pure client and server functions; the driver (feddra_driver) runs clients
    one at a time on ONE workspace network and adds each message to the server's sums."""

    name = "feddra"
    share_frozen_pass = True  # stage 1 live: one frozen encoder pass for model and anchor (exact; off: two)

    def __init__(self, cfg: FedDRAConfig = FedDRAConfig()) -> None:
        self.cfg = cfg

    def init(self, net: DualEncoder, num_clients: int) -> FDServerState:
        state, pkeys = net.state(2), set(net.parameter_keys(2))
        model = GlobalModel({k: v.clone() for k, v in state.items() if k in pkeys},
                            {k: v.clone() for k, v in state.items() if k not in pkeys})
        return FDServerState(model, torch.from_numpy(dro.uniform(num_clients)))

    def scales(self, ss: FDServerState) -> np.ndarray:
        """s_i of this round: lambda^r (never lambda^{r+1}: the notes' off-by-one of Alg. 2/3)."""
        return dro.step_scale(ss.lam.numpy(), self.cfg.step_scaling)

    # ---------------------------------------------------------------- client
    def embed(self, net: DualEncoder, b: PairBatch, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(zx, zy) of a batch: cached token states, or live encoders (frozen in stage 1)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and stage == 2):
            img, txt, txt_mask = _tokens(net, b)
        return net.align(img, b.img_mask, txt, txt_mask)

    @staticmethod
    @torch.no_grad()
    def frozen_tokens(net: DualEncoder, b: PairBatch) -> PairBatch:
        """`b` with the live inputs replaced by the frozen encoders' token states (stage 1)."""
        img, txt, txt_mask = _tokens(net, b)
        return PairBatch(img_tok=img, img_mask=b.img_mask, txt_tok=txt, txt_mask=txt_mask, anchor=b.anchor)

    def local_loss(self, net: DualEncoder, anchor: DualEncoder | None, b: PairBatch, stage: int,
                   shared: bool = False) -> torch.Tensor:
        """L_local = L_MI + mu L_C (Eq. 1); the anchor runs without gradient. `shared` (stage 1,
        anchor encoders == net encoders, both frozen): a live batch is encoded once and both the
        model and the anchor read those token states, so the anchor costs module passes only."""
        if shared and stage == 1 and (b.img_tok is None or b.txt_tok is None):
            b = self.frozen_tokens(net, b)
        zx, zy = self.embed(net, b, stage)
        loss = l_mi(zx, zy, self.cfg)
        if self.cfg.mu > 0:
            if anchor is None and b.anchor is None:
                raise UserError("FedDRA: mu > 0 needs the frozen global model (anchor)")
            if b.anchor is not None:  # precomputed on the same cached inputs (feddra_driver.anchor_outputs)
                ax, ay = b.anchor
            else:
                with torch.no_grad():
                    ax, ay = self.embed(anchor, b, stage)
            loss = loss + self.cfg.mu * l_c(zx, zy, ax, ay, self.cfg)
        return loss

    @torch.no_grad()
    def client_value(self, net: DualEncoder, anchor: DualEncoder | None, batches: Iterable[PairBatch],
                     stage: int) -> float:
        """v_i (Alg. 1 lines 13-16): mean InfoNCE (or L_local) over the fixed batches, eval mode."""
        net.eval()
        vals = []
        shared = None
        for b in batches:
            if self.cfg.dro_loss == "local" and self.cfg.mu > 0:
                shared = self._shared_for(b, net, anchor, stage, shared)
                vals.append(float(self.local_loss(net, anchor, b, stage, bool(shared))))
            else:
                zx, zy = self.embed(net, b, stage)
                vals.append(float(l_mi(zx, zy, self.cfg)))
        return float(np.mean(vals)) if vals else math.nan

    def shares_encoders(self, net: DualEncoder, anchor: DualEncoder | None, stage: int) -> bool:
        """Stage 1 with L_C: may the anchor read the model's frozen token states? Only when its
        encoders hold exactly the model's weights (always so in the driver: both are the round's
        global encoders in stage 1); checked once per client update, not assumed."""
        if stage != 1 or anchor is None or self.cfg.mu <= 0 or not self.share_frozen_pass:
            return False
        a, b = anchor.state_dict(), net.state_dict()
        return all(torch.equal(v, a[k]) for k, v in b.items() if not k.startswith(("psi.", "phi.")))

    def _shared_for(self, b: PairBatch, net: DualEncoder, anchor: DualEncoder | None, stage: int,
                    known: bool | None) -> bool | None:
        """shares_encoders, evaluated at the first live batch of a client update (cached batches
        never need it, and the check reads every encoder weight once)."""
        if known is None and stage == 1 and (b.img_tok is None or b.txt_tok is None):
            return self.shares_encoders(net, anchor, stage)
        return known

    def client_update(self, stage: int, bc: GlobalModel, batches: Iterable[PairBatch], scale: float, client: int,
                      net: DualEncoder, anchor: DualEncoder | None,
                      value_batches: Iterable[PairBatch] | None = None, weight: float = 1.0) -> FDMessage:
        """E local steps of stage 1 (Alg. 2: Theta only) or stage 2 (Alg. 3: all parameters) from
        the broadcast, learning rates times s_i (the weight decay's product lr * wd kept at the
        unscaled lr's: the decay is ours, not the paper's, and must not follow lambda); then v_i when
        `value_batches` are given. `weight` is the client's aggregation weight (1, or n_i).
        `net` is the one workspace network: its state is overwritten."""
        cfg = self.cfg
        net.load_state({**bc.params, **bc.buffers})
        net.set_mode(stage)
        named = net.named_trained(stage)
        # torch applies lr * weight_decay per step (AdamW: w *= 1 - lr wd; SGD: lr (g + wd w)), so the
        # group's decay is wd / s_i: the decay per step stays lr * wd at any s_i (exactly wd at s_i = 1)
        wd = cfg.weight_decay / scale if scale > 0 else 0.0
        groups = [{"params": [p for k, p in named if is_module_key(k)], "lr": cfg.lr * scale, "weight_decay": wd},
                  {"params": [p for k, p in named if not is_module_key(k)], "lr": cfg.encoder_lr * scale,
                   "weight_decay": wd}]
        groups = [g for g in groups if g["params"]]
        if cfg.optimizer == "adamw":
            opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        else:
            opt = torch.optim.SGD(groups, weight_decay=cfg.weight_decay)
        start = [p.detach().clone() for _, p in named] if cfg.prox_mu else []
        autocast, scaler = _amp(cfg.amp, next(iter(bc.params.values())).device)
        shared = None
        for b in batches:
            shared = self._shared_for(b, net, anchor, stage, shared)
            with autocast():
                loss = self.local_loss(net, anchor, b, stage, bool(shared))
            if cfg.prox_mu:  # FedProx (Li et al. 2020, Eq. 2)
                loss = loss + 0.5 * cfg.prox_mu * sum(((p - s) ** 2).sum() for (_, p), s in zip(named, start))
            optimizer_step(opt, scaler, loss)
        v = math.nan if value_batches is None else self.client_value(net, anchor, value_batches, stage)
        now = net.state(stage)
        send = self.sent_keys(stage, net)
        dev = next(iter(bc.params.values())).device
        w = torch.full((1,), float(weight), dtype=torch.float64, device=dev)
        return FDMessage({k: (now[k] - bc.params[k]).unsqueeze(0) for k in send if k in bc.params},
                         {k: (now[k] - bc.buffers[k]).unsqueeze(0) for k in send if k in bc.buffers},
                         w, torch.tensor([v], dtype=torch.float64, device=dev),
                         torch.tensor([client], dtype=torch.int64, device=dev))

    def sent_keys(self, stage: int, net: DualEncoder) -> tuple[str, ...]:
        """What a client uploads after `stage`: Theta after stage 1; theta (and [R] Theta) after stage 2."""
        keys = tuple(net.state(stage))
        if stage == 2 and not self.cfg.aggregate_modules_after_stage2:
            keys = tuple(k for k in keys if not is_module_key(k))
        return keys

    # ---------------------------------------------------------------- server
    def sums_init(self, ss: FDServerState) -> FDSums:
        dev = ss.lam.device
        return FDSums({}, {}, torch.zeros((), dtype=torch.float64, device=dev),
                      torch.full_like(ss.lam, math.nan))

    @staticmethod
    def sums_add(sums: FDSums, msg: FDMessage) -> FDSums:
        """sums + the message's contributions summed over its client axis (in place, returned)."""
        for acc, part in ((sums.delta, msg.delta), (sums.buffer_delta, msg.buffer_delta)):
            for k, d in part.items():
                s = (msg.weight.to(d.dtype).view(-1, *([1] * (d.dim() - 1))) * d).sum(0)
                acc[k] = acc[k] + s if k in acc else s
        v = sums.v.clone()
        v[msg.client.to(v.device)] = msg.v.to(v.dtype)
        return FDSums(sums.delta, sums.buffer_delta, sums.weight + msg.weight.sum(), v)

    def server_finalize(self, ss: FDServerState, sums: FDSums) -> FDServerState:
        """w <- w + S / W over the keys the clients sent, W the sum of the clients' weights: N with
        Alg. 1's weights of 1 (lines 7 and 12), sum_j n_j with aggregation "samples"."""
        if float(sums.weight) <= 0:
            return ss
        n = sums.weight
        params = {k: v + sums.delta[k] / n.to(v.dtype) if k in sums.delta else v for k, v in ss.model.params.items()}
        buffers = {k: v + sums.buffer_delta[k] / n.to(v.dtype) if k in sums.buffer_delta else v
                   for k, v in ss.model.buffers.items()}
        return FDServerState(GlobalModel(params, buffers), ss.lam)

    def server_aggregate(self, ss: FDServerState, msg: FDMessage) -> FDServerState:
        """The stacked form: all participants' messages at once."""
        return self.server_finalize(ss, self.sums_add(self.sums_init(ss), msg))

    def update_lambda(self, ss: FDServerState, v: torch.Tensor) -> FDServerState:
        """lambda^{r+1} = Proj_Q(lambda^r exp(gamma v) / sum) (Alg. 1 line 18, Eq. 2)."""
        lam = dro.update(ss.lam.cpu().numpy(), v.cpu().numpy(), self.cfg.dro)
        return FDServerState(ss.model, torch.from_numpy(lam).to(ss.lam.device))
