"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1, first-order
variant "Per-FedAvg (FO)", Sec. 4 / Eq. 9) on the baselines' head of FedPCL (NeurIPS 2022,
Table 7: FC(K*d, 256)-ReLU-BN(256), L2-normalised as the core's FedAvg head, then FC(256, C)).

Meta-objective F_i(w) = f_i(w - alpha grad f_i(w)) (Eq. 3). Each participant starts from the
global w and, for every local step (E epochs of mini-batches), draws two independent batches
D and D' and does
    w_tmp = w - alpha * grad f_i(w; D)                (Alg. 1 line 6)
    w     = w - beta  * grad f_i(w_tmp; D')           (Alg. 1 line 7, FO: the Hessian term is dropped)
then sends w_i - w with weight n_i; the server averages (Alg. 1 line 10, n_i-weighted).

Decisions, stated explicitly:
- D and D' come from two independently shuffled passes over the client's data (same number of
  steps), so one "local step" touches each sample once per pass.
- alpha = 0.005 and the outer step beta = 0.001 are the pFedMe authors' Per-FedAvg comparison
  run (GitHub CharlieDinh/pFedMe). The outer step is taken by the core optimiser ``optimizer``,
  by default FedPCL Sec. 5.1's setting for all baselines (Adam lr 1e-3 = beta, wd 1e-4), fresh
  every round as in the core's FedAvg; pass
  OptimizerConfig("sgd", lr=0.001, weight_decay=0) for the paper's plain step.
- Only the first-order variant is implemented (the HF variant's Hessian-vector product is not).
- Personalised evaluation ("main"): one gradient step of size alpha on the client's whole
  training set from the server's CURRENT global model, theta_i = w - alpha grad f_i(w) (eval-mode
  BN, the global running statistics), for every client, computed by the engines' eval-time hook
  `adapt_for_eval` (core/protocol.py). This is what PFLlib's Per-FedAvg evaluates (its server
  sends the latest global model to every client and evaluates after one local step from it),
  and what the pFedMe authors' comparison does ("one step" from the global model); adapting the
  model a client received before its last round would report last round's global model.
  "global_model": the server's current w without adaptation."""

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
    salted,
    schedule,
    step_batch,
    step_buffers,
)
from fedheads.core import heads, ops
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import HeadSpec, Params
from fedheads.core.optim import InPlaceOptimizer, OptimizerConfig
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx
from fedheads.core.train import fresh_opt_state


@dataclass(frozen=True)
class PerFedAvgConfig:
    """Per-FedAvg (FO) hyper-parameters."""

    hidden: int = setting(256, "projection width (FedPCL Table 7)", source="FedPCL Table 7")
    normalize: bool = setting(True, "L2-normalise the projection output")
    alpha: float = setting(0.005, "inner (adaptation) step size, also used for the personalised evaluation")
    optimizer: OptimizerConfig = setting(doc="outer step: Adam lr 1e-3 (= beta), wd 1e-4", default_factory=OptimizerConfig,
                                         source="FedPCL Sec. 5.1")
    batch_size: int = setting(32, "size of each of the batches D and D'")
    local_epochs: int = setting(1, "E: passes over the data (of D's and of D''s shuffles)")

    def __post_init__(self) -> None:
        if min(self.hidden, self.batch_size, self.local_epochs) < 1 or self.alpha <= 0:
            raise UserError(f"hidden/batch_size/local_epochs ({self.hidden}, {self.batch_size}, "
                            f"{self.local_epochs}) must be >= 1 and alpha {self.alpha} > 0")


@dataclass(frozen=True)
class PerFedAvgClientState:
    personal: Params  # [M, ...] theta_i = w - alpha grad f_i(w) for the last evaluated global w
    buffers: Params  # [M, ...] BN running statistics of that w (used with theta_i)


class PerFedAvg(AlgorithmBase):
    """Per-FedAvg, first-order MAML variant."""

    name = "perfedavg"
    global_rule = "global_model"  # predict's key for the server model alone

    def __init__(self, cfg: PerFedAvgConfig = PerFedAvgConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        head = HeadSpec(spec.dim, self.cfg.hidden, spec.num_classes, True, self.cfg.normalize)
        g, b = heads.init_global(head, seed, spec.device)
        M = spec.num_clients
        return Init(PerFedAvgClientState(expand(g, M), expand(b, M)), GlobalModel(g, b),
                    GlobalModel(g, b))

    def _loss(self, train: bool, params: Params):
        spec = heads.spec_of(params, self.cfg.normalize)

        def loss_fn(p: Params, b: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
            z, nb = heads.embed(spec, p, b, x, m, train=train)
            return ops.masked_cross_entropy(heads.classify(p, z), y, m), nb

        return loss_fn

    def personalize(self, params: Params, buffers: Params, data: FedData) -> Params:
        """theta_i = w - alpha * grad f_i(w) on the whole training set (eval-mode BN)."""
        g, _, _ = grads(self._loss(False, params), params, buffers, data.x_train, data.y_train, data.m_train)
        return {k: params[k] - self.cfg.alpha * g[k] for k in params}

    def client_update(self, cs: PerFedAvgClientState, bc: GlobalModel, data: FedData,
                      ctx: RoundCtx) -> tuple[PerFedAvgClientState, DeltaMessage]:
        cfg = self.cfg
        M = data.num_clients
        w0, b0 = expand_view(bc.params, M), expand_view(bc.buffers, M)
        loss_fn = self._loss(True, bc.params)
        w, buf = expand(bc.params, M), b0  # w is stepped in place by the fused optimiser (active clients only)
        # the moments are discarded at the end of the round: reused scratch, as local_train's reset
        opt = InPlaceOptimizer(cfg.optimizer, w, fresh_opt_state(cfg.optimizer, w, keep=False))
        tmp = {k: ops.scratch(f"perfedavg.tmp.{k}", v) for k, v in w.items()}
        # clients by step count where that saves work: a step computes only rows [0, k), the clients
        # still stepping (core/train.py); they all start from the same w, BN statistics and zero
        # moments, so only the results are put back in order. D and D' have the same step counts,
        # hence the same order.
        perm, sa = order_by_steps(schedule(data, ctx, cfg.batch_size, cfg.local_epochs))  # batches D
        _, sb = order_by_steps(schedule(data, salted(ctx, 1), cfg.batch_size, cfg.local_epochs))  # batches D'
        with ops.grad_workspace():  # each gradient lands in a reused buffer, consumed before the next
            for s in range(sa.num_steps):
                act = sa.active[s]
                k = prefix_len(sa.ids[s], M)  # the clients stepping are rows [0, k), or k = M
                x, y, v = step_batch(data, sa, s, k, perm)
                ops.new_step()
                g, nb, _ = grads(loss_fn, rows(w, k), rows(buf, k), x, y, v)
                for n in w:  # the inner step w_tmp = w - alpha grad f_i(w; D)
                    torch.add(w[n][:k], g[n], alpha=-cfg.alpha, out=tmp[n][:k])
                x2, y2, v2 = step_batch(data, sb, s, k, perm)
                ops.new_step()
                g2, nb2, _ = grads(loss_fn, rows(tmp, k), nb, x2, y2, v2)
                opt.step(g2, act, sa.ids[s])  # FO: the gradient at w_tmp (on D') applied to w
                buf = step_buffers(act, nb2, buf, k < M)
        w, buf = in_data_order(perm, w, buf)
        return cs, delta_message(w, w0, buf, b0, data)

    def adapt_for_eval(self, cs: PerFedAvgClientState, ss: GlobalModel, data: FedData) -> PerFedAvgClientState:
        """Eval-time hook: every client's one-step personalisation of the current global model."""
        M = data.num_clients
        w, b = expand(ss.params, M), expand(ss.buffers, M)
        return PerFedAvgClientState(self.personalize(w, b, data), b)

    def server_aggregate(self, ss: GlobalModel, msg: DeltaMessage,
                         ctx: RoundCtx) -> tuple[GlobalModel, GlobalModel]:
        new = apply_mean_delta(ss, msg)
        return new, new

    def predict(self, cs: PerFedAvgClientState, ss: GlobalModel, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return personal_and_global_scores(heads.spec_of(ss.params, self.cfg.normalize), cs.personal, cs.buffers, ss, x, mask)

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """The whole head each way, as FedAvg (FedPCL Table 2)."""
        up = arch.in_dim * arch.proj_dim + arch.proj_dim * arch.num_classes
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: PerFedAvgClientState) -> int:
        return heads.count_params(cs.personal)


def _factory(**kw: object) -> PerFedAvg:
    return PerFedAvg(config_from_kwargs(PerFedAvgConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("perfedavg", _factory,
                   description="Per-FedAvg (Fallah et al. 2020), first-order MAML, one-step personalised eval",
                   config=PerFedAvgConfig)
