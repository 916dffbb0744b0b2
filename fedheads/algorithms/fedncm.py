"""FedNCM (Legate et al., "Guiding The Last Layer in Federated Learning with Pre-Trained
Models", NeurIPS 2023, Sec. 3.2, Algorithm 1) on cached features.

Client k sends, once, its per-class feature sums m_c^k = sum_{x in X_c^k} f(x) and counts
n_c^k (Alg. 1 lines 7-12); the server forms the exact class means l_c = sum_k m_c^k /
sum_k n_c^k (Alg. 1 line 5, D_c = sum_k n_c^k). Written as sums of client contributions plus
a finalize, so it runs unchanged under secure aggregation. Classes no client holds get no
mean and are flagged absent (``present`` = False); they are never predicted.

Classifier ("main" rule, configurable):
  * ``"cosine"`` (default): argmax_c <x, l_c/||l_c||>, i.e. the linear head the paper builds
    from FedNCM (Sec. 3.2: v_c = l_c/||l_c||, b = 0); its argmax equals the cosine-similarity
    nearest class mean because ||x|| does not depend on c.
  * ``"sqeuclidean"``: the classical NCM, argmin_c ||x - l_c||^2 (Sec. 2, "distances between
    them and the class means").
Both are reported every evaluation; ``rule`` picks which one is "main".

Sums and counts are accumulated in float64 (``dtype``), so the federated means equal the
centralised NCM of the pooled data to float64 rounding; ``dtype="float32"`` halves the
upload (the paper's Appendix A counts 32-bit values) at float32 rounding.

FedNCM is one round with every client (Alg. 1). Run it with ``rounds=1, fraction=1``. With
partial participation run enough rounds to reach every client: the server keeps adding
contributions, and a client that has already contributed sends zeros (the engine still
counts that message as traffic).

:func:`linear_head_init` turns the means into the FedNCM+FT head: weight l_c/||l_c||, bias 0
as in the paper, or ``bias="authors-code"`` as the authors' code does (their head keeps the
random bias of its ``nn.Linear``, drawn exactly as torch draws it: :func:`authors_code_bias`).

``bias`` also picks the FedNCM head itself: ``"paper"`` (default) is the argmax above;
``"authors-code"`` scores x . l_c/||l_c|| + b_c on the unnormalised features with that random
bias (GitHub GwenLegate/GuidingLastLayerFLPretrain), the head behind the paper's published
FedNCM column. The bias is drawn once from the run's seed and kept in the server state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import Params
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

RULES = ("cosine", "sqeuclidean")
BIASES = ("paper", "authors-code")
_BIAS_ALIASES = {"zero": "paper", "random": "authors-code"}  # the names FedNCM+FT options used first
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class FedNCMConfig:
    """FedNCM settings (the paper has no hyper-parameters)."""

    rule: str = setting("cosine", "\"main\" prediction rule: \"cosine\" (paper's head) or \"sqeuclidean\"")
    dtype: str = setting("float64", 'accumulation and message dtype of the sums: "float64" | "float32"')
    bias: str = setting("paper", "head bias: \"paper\" (b = 0, Sec. 3.2) | \"authors-code\" (nn.Linear's random bias kept)",
                        source="FedNCM Sec. 3.2")


@dataclass(frozen=True)
class FedNCMClientState:
    sent: torch.Tensor  # [M] bool: this client's statistics have reached the server


@dataclass(frozen=True)
class FedNCMServerState:
    sums: torch.Tensor  # [C, D] sum over clients of per-class feature sums (Alg. 1 line 5)
    counts: torch.Tensor  # [C] D_c = total training samples of class c
    means: torch.Tensor  # [C, D] l_c = sums / counts (zeros for absent classes)
    present: torch.Tensor  # [C] bool: D_c > 0
    bias: torch.Tensor | None = None  # [C] authors'-code head: nn.Linear's random bias (None: the paper's b = 0)


@dataclass(frozen=True)
class FedNCMBroadcast:
    """Nothing: the frozen backbone is already on the clients (features are cached)."""


@dataclass(frozen=True)
class FedNCMMessage:
    sums: torch.Tensor  # [M, C, D] per-class feature sums m_c^k (Alg. 1 line 9)
    counts: torch.Tensor  # [M, C] int64 samples per class n_c^k


def client_stats(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int,
                 dtype: torch.dtype = torch.float64, block_rows: int = 1024,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """LocalClientStats (Alg. 1 lines 7-12) for stacked clients: sums [M,C,D], counts [M,C].

    One index_add per block of rows over all clients (no [N, C] one-hot); padding rows (mask
    False) go to a dump slot. Blocks keep the float64 copy cache-sized: converting a whole
    [N, D] client at once is ~10x slower than the adds themselves."""
    M, N, D = x.shape
    C = num_classes
    slot = torch.where(mask, torch.arange(M, device=x.device).view(M, 1) * C + y,
                       torch.full_like(y, M * C)).reshape(-1)
    flat = x.reshape(M * N, D)
    sums = torch.zeros(M * C + 1, D, dtype=dtype, device=x.device)
    for a in range(0, M * N, block_rows):
        sums.index_add_(0, slot[a:a + block_rows], flat[a:a + block_rows].to(dtype))
    counts = torch.bincount(slot, minlength=M * C + 1)
    return sums[:-1].view(M, C, D), counts[:-1].view(M, C)


def finalize_means(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(means [C,D], present [C]) from summed statistics; absent classes get zero rows."""
    present = counts > 0
    denom = counts.clamp(min=1).to(sums.dtype).unsqueeze(-1)
    return torch.where(present.unsqueeze(-1), sums / denom, torch.zeros_like(sums)), present


def ncm_scores(means: torch.Tensor, present: torch.Tensor, x: torch.Tensor, rule: str) -> torch.Tensor:
    """Scores [..., C] (higher = nearer) of features x [..., D]; absent classes get -inf."""
    dt = torch.promote_types(x.dtype, means.dtype)  # float64 means keep float64 distances
    x, m = x.to(dt), means.to(dt)
    if rule == "cosine":
        s = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(m, dim=-1).T
    elif rule == "sqeuclidean":  # -(|x|² - 2 x·m + |m|²), in place on the one [..., C] tensor made
        s = (x @ m.T).mul_(-2).add_((x * x).sum(-1, keepdim=True)).add_((m * m).sum(-1)).neg_()
    else:
        raise UserError(f"rule={rule!r}: must be one of {', '.join(RULES)}")
    return s.masked_fill_(~present.to(s.device), float("-inf"))


def head_bias(name: str) -> str:
    """The canonical bias name ("paper" | "authors-code"); "zero" / "random" are accepted too."""
    canon = _BIAS_ALIASES.get(name, name)
    if canon not in BIASES:
        raise UserError(f"bias={name!r}: must be one of {', '.join(BIASES)}")
    return canon


def authors_code_bias(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """The bias [C] of ``torch.manual_seed(seed); nn.Linear(dim, num_classes)``: torch's own
    initialisation (weight first, then bias ~ U(-1/sqrt(dim), 1/sqrt(dim))), bit for bit. The
    global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return torch.nn.Linear(dim, num_classes).bias.detach().clone()


def linear_head_init(means: torch.Tensor, present: torch.Tensor, bias: str = "paper",
                     seed: int = 0) -> Params:
    """FedNCM head for fine-tuning (Sec. 3.2): {"cls.weight": [D, C], "cls.bias": [C]} in the
    core's layout (weights transposed, no client axis).

    Weight column c = l_c/||l_c|| (zeros for absent classes). ``bias="paper"`` is the paper's 0;
    ``bias="authors-code"`` keeps nn.Linear's random init, as the authors' code does
    (:func:`authors_code_bias` of ``seed``)."""
    C, D = means.shape
    w = torch.nn.functional.normalize(means.to(torch.float32), dim=-1)
    w = torch.where(present.view(C, 1), w, torch.zeros_like(w))
    b = torch.zeros(C) if head_bias(bias) == "paper" else authors_code_bias(C, D, seed)
    return {"cls.weight": w.T.contiguous(), "cls.bias": b.to(w.device)}


def class_scores(weight: torch.Tensor, bias: torch.Tensor, present: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x·w_c + bias_c [..., C] of features x [..., D] (in the wider of their dtypes); absent
    classes -inf. The linear heads' scores (this file's, Fed3R's, FedCOF's)."""
    dt = torch.promote_types(x.dtype, weight.dtype)
    s = x.to(dt) @ weight.to(dt).T  # the one [..., C] tensor made: the bias and the mask are applied in place
    return s.add_(bias.to(device=x.device, dtype=dt)).masked_fill_(~present.to(s.device), float("-inf"))


def linear_scores(means: torch.Tensor, present: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The authors' head, x . l_c/||l_c|| + b_c on unnormalised x [..., D] -> [..., C]; absent
    classes -inf (never predicted, as under the paper's rule)."""
    dt = torch.promote_types(x.dtype, means.dtype)
    return class_scores(torch.nn.functional.normalize(means.to(dt), dim=-1), bias, present, x)


def fedncm_secure_form(dtype: torch.dtype, aggregate: Callable) -> SecureForm:
    """The secure form of FedNCM's statistics message (also LP's FedNCM round): sums and counts
    are secure sums; `aggregate` (a server_aggregate) runs on one row holding the totals."""

    def agg(ss: object, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
        return aggregate(ss, FedNCMMessage(tot["sums"].to(dtype)[None], tot["counts"].round().to(torch.int64)[None]), ctx)

    return SecureForm(lambda m: {"sums": m.sums[0].double(), "counts": m.counts[0].double()}, ("counts",),
                      lambda m: None, agg)


class FedNCM(AlgorithmBase):
    """FedNCM in the core's algorithm protocol (one round, no training)."""

    name = "fedncm"
    global_rule = "main"  # every client classifies by the server's class means
    sums_messages = True  # the server reads only sum_k m_c^k and sum_k n_c^k (Alg. 1 line 5)
    one_pass = True  # each client sends its statistics once

    def __init__(self, cfg: FedNCMConfig = FedNCMConfig()) -> None:
        if cfg.rule not in RULES:
            raise UserError(f"rule={cfg.rule!r}: must be one of {', '.join(RULES)}")
        if cfg.dtype not in _DTYPES:
            raise UserError(f"dtype={cfg.dtype!r}: must be one of {', '.join(_DTYPES)}")
        self.bias = head_bias(cfg.bias)
        if self.bias == "authors-code" and cfg.rule != "cosine":
            raise UserError(f"bias=authors-code is the authors' linear head (in place of rule=cosine); "
                            f"it does not combine with rule={cfg.rule!r}")
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.seed_free = self.bias != "authors-code"  # the authors' bias is drawn from the seed

    def init(self, spec: DataSpec, seed: int) -> Init:
        C, D, dev = spec.num_classes, spec.dim, spec.device
        z = torch.zeros(C, D, dtype=self.dtype, device=dev)
        bias = authors_code_bias(C, D, seed).to(dev) if self.bias == "authors-code" else None
        ss = FedNCMServerState(z, torch.zeros(C, dtype=torch.int64, device=dev), z.clone(),
                               torch.zeros(C, dtype=torch.bool, device=dev), bias)
        cs = FedNCMClientState(torch.zeros(spec.num_clients, dtype=torch.bool, device=dev))
        return Init(cs, ss, FedNCMBroadcast())

    def client_update(self, cs: FedNCMClientState, bc: FedNCMBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedNCMClientState, FedNCMMessage]:
        sums, counts = client_stats(data.x_train, data.y_train, data.m_train, data.num_classes,
                                    self.dtype)
        fresh = ~cs.sent.to(sums.device)  # a client contributes exactly once
        sums = sums * fresh.view(-1, 1, 1).to(sums.dtype)
        counts = counts * fresh.view(-1, 1).to(counts.dtype)
        return FedNCMClientState(torch.ones_like(cs.sent)), FedNCMMessage(sums, counts)

    def summed_update(self, cs: FedNCMClientState, bc: FedNCMBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedNCMClientState, FedNCMMessage]:
        """sum_k m_c^k and sum_k n_c^k of the clients in `data` (those that have not sent yet) as
        one row, from their rows pooled: no per-client [C, D] sums are made."""
        M, N, D = data.x_train.shape
        rows = data.m_train & ~cs.sent.to(data.m_train.device).view(-1, 1)
        sums, counts = client_stats(data.x_train.reshape(1, M * N, D), data.y_train.reshape(1, M * N),
                                    rows.reshape(1, M * N), data.num_classes, self.dtype)
        return FedNCMClientState(torch.ones_like(cs.sent)), FedNCMMessage(sums, counts)

    def server_aggregate(self, ss: FedNCMServerState, msg: FedNCMMessage,
                         ctx: RoundCtx) -> tuple[FedNCMServerState, FedNCMBroadcast]:
        sums = ss.sums + msg.sums.sum(0)  # sum of client contributions ...
        counts = ss.counts + msg.counts.sum(0)
        means, present = finalize_means(sums, counts)  # ... then finalize (Alg. 1 line 5)
        return FedNCMServerState(sums, counts, means, present, ss.bias), FedNCMBroadcast()

    def predict(self, cs: FedNCMClientState, ss: FedNCMServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if not bool(ss.present.any()):
            raise UserError("fedncm: no class means yet (run at least one round)")
        out = {r: ncm_scores(ss.means, ss.present, x, r) for r in RULES}
        if ss.bias is not None:  # the authors' head: its own rule, and the main one
            out["linear"] = linear_scores(ss.means, ss.present, ss.bias, x)
            return {"main": out["linear"], **out}
        return {"main": out[self.cfg.rule], **out}

    def prototype_view(self, cs: FedNCMClientState, ss: FedNCMServerState, x: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """For faiss batch prediction (fedheads.predict): the queries are the features
        themselves and every client shares the server's class means l_c. The authors' head is
        an inner product of [x, 1] with [l_c/||l_c||, b_c]."""
        M = x.shape[0]
        if ss.bias is not None:
            dt = torch.promote_types(x.dtype, ss.means.dtype)
            q = torch.cat([x.to(dt), torch.ones(*x.shape[:-1], 1, dtype=dt, device=x.device)], -1)
            w = torch.nn.functional.normalize(ss.means.to(dt), dim=-1)
            p = torch.cat([w, ss.bias.to(device=w.device, dtype=dt).unsqueeze(-1)], -1)
            return q, p.unsqueeze(0).expand(M, -1, -1), ss.present.unsqueeze(0).expand(M, -1), "ip"
        return x, ss.means.unsqueeze(0).expand(M, -1, -1), ss.present.unsqueeze(0).expand(M, -1), self.cfg.rule

    def linear_head(self, ss: FedNCMServerState) -> Params:
        """The FedNCM+FT head (Sec. 3.2): weight l_c/||l_c||, bias 0, or the authors' code's
        random bias that ``bias="authors-code"`` keeps in the state."""
        head = linear_head_init(ss.means, ss.present, "paper")
        if ss.bias is not None:
            head["cls.bias"] = ss.bias.to(head["cls.bias"])
        return head

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees only sum_k m_c^k and sum_k n_c^k (Alg. 1 lines 5, 7-12)."""
        return fedncm_secure_form(self.dtype, self.server_aggregate)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, its feature clipped to L2 norm `clip`, moves one class sum by at most
        `clip` and one count by 1 (add/remove adjacency)."""
        return {"sums": float(clip), "counts": 1.0}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Class sums in the backbone space, C x D, each way (FedNCM Appendix A, Eq. 3)."""
        up = arch.num_classes * arch.in_dim
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: FedNCMClientState) -> int:
        return 0  # nothing is trained: the means are computed in closed form


def _factory(**kw: object) -> FedNCM:
    return FedNCM(FedNCMConfig(**kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedncm", _factory, description="FedNCM (Legate et al. 2023): exact federated class means, NCM classifier",
                   config=FedNCMConfig)
