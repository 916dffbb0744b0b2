"""FedCOF (Goswami et al., "Covariances for Free: Exploiting Mean Distributions for
Training-free Federated Learning", NeurIPS 2025): a ridge-regression classifier whose
second-order statistics the server estimates from the client class means alone, at FedNCM's
communication.

Client k sends its per-class means μ_kc and counts n_kc of the classes it holds, with their labels
(federate_classes.py ``FedCOFClient``: a dict over the client's own classes). The message keeps
them as (client, class) pairs, each client's run in ascending class order (``FedCOFMessage``), so
its size follows the pairs, not clients x classes.
The server forms, for each class c held by K_c clients with N_c = Σ_k n_kc samples:
  μ_c  = Σ_k n_kc μ_kc / N_c                                   (the exact class mean, as FedNCM)
  Σ̂_c  = Σ_k n_kc (μ_kc − μ_c)(μ_kc − μ_c)ᵀ / (K_c − 1) + γI  (the unbiased covariance estimator
        from the spread of the client means, plus the shrinkage γ; K_c = 1 divides by 1 there, and
        the spread of one mean is 0 anyway)
  G    = Σ_c (N_c − 1) Σ̂_c + N ḡḡᵀ                              (ḡ the global mean, N = Σ_c N_c)
  W    = G⁺ [N_c μ_c]_c, each class's weight normalised, no bias (``FedCOFServer.aggregate``,
        ``get_classifier_weights``).
G keeps only the within-class covariances and the global mean: the paper shows that dropping the
between-class scatter Σ_c N_c (μ_c − ḡ)(μ_c − ḡ)ᵀ of the full Gram gives the better classifier;
``between_class=True`` adds it back (then G estimates XᵀX itself, Fed3R's Gram without the bias
column). The solve factorises G with Cholesky (G is positive definite when γ > 0 and some class
has two samples) and falls back to the pseudo-inverse the authors' code always uses, logging it
and setting ``pinv`` in the server state.

The estimator needs every client's means, not only their sums (N_c and K_c, hence each class's
weight in G, are known only once every holder of c has sent): the server keeps the (client,
class) means it has received in a bank of exactly those pairs, sorted by (client position, class),
so the head does not depend on the order or grouping in which clients arrive, and partial
participation works as FedNCM's: a client sends its means once, and every round that brings new
means re-estimates G from all clients seen. The bank grows with the pairs received (one row each,
nothing reserved at init; after one round of every client it is the message's own tensors), and G
is formed from it a block of rows at a time (``estimated_gram``), so the server never holds a
second copy of the bank or the whole spread of the means.

The authors' client also builds a jittered second copy of a class's only sample, but never uses
it (the mean and count it sends are those of the one sample): there is nothing to reproduce.

Under SecAgg+ FedCOF is refused (``secure_form``): the server must see each client's means to
measure their spread; the equivalent sums Σ_k n_kc μ_kc μ_kcᵀ are C·D² values per client."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.algorithms.fed3r import DTYPES, linear_head, normalise_classes, solve_psd
from fedheads.algorithms.fedncm import class_scores
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

SPREAD_ROWS = 2048  # bank rows whose spread estimated_gram forms at a time (two such blocks of float64)


@dataclass(frozen=True)
class FedCOFConfig:
    """FedCOF settings."""

    gamma: float = setting(1.0, "shrinkage gamma added to each estimated class covariance",
                           source="FedCOF covariance shrinkage; --gamma_shrink default 1 in dipamgoswami/FedCOF "
                                  "server_aggregate.py")
    between_class: bool = setting(False, "add the between-class scatter to the estimated Gram (the paper's "
                                         "ablation); False: within-class covariances and the global mean only",
                                  source="FedCOF classifier initialisation with within-class covariances")
    dtype: str = setting("float64", "dtype of the class means sent and of the server's bank of them (its sums, "
                                    "spread and Gram accumulate in float64): float64 | float32")


@dataclass(frozen=True)
class FedCOFClientState:
    sent: torch.Tensor  # [M] bool: this client's means have reached the server


@dataclass(frozen=True)
class FedCOFServerState:
    cap: torch.Tensor  # [M] int64 the most classes client k can hold: min(n_k, C)
    bank_means: torch.Tensor  # [Q, D] the received client class means mu_kc (in `dtype`), Q = pairs received
    bank_client: torch.Tensor  # [Q] int64 their client's position k (rows sorted by (k, c))
    bank_class: torch.Tensor  # [Q] int64 their class c
    bank_count: torch.Tensor  # [Q] int64 n_kc (>= 1)
    sums: torch.Tensor  # [C, D] float64 N_c mu_c
    counts: torch.Tensor  # [C] int64 N_c
    weight: torch.Tensor  # [C, D] float64 normalised classifier (zero for absent classes)
    present: torch.Tensor  # [C] bool: some client holds class c
    pinv: torch.Tensor  # [] bool: the last solve fell back to the pseudo-inverse


@dataclass(frozen=True)
class FedCOFBroadcast:
    """Nothing: the frozen backbone is already on the clients (features are cached)."""


@dataclass(frozen=True)
class FedCOFMessage:
    """The means of the classes each client holds, as runs of (client, class) pairs: client i's
    run is items [start_i, start_i + pairs[i]) with start_i = pairs[:i].sum(), in ascending class
    order. Two messages concatenated leaf by leaf are the message of their clients in order
    (core.tree.RaggedRows)."""

    pairs: torch.Tensor  # [M] int64 classes each client sends (0 once it has sent them)
    means: torch.Tensor  # [Q, D] class means mu_kc, Q = pairs.sum()
    classes: torch.Tensor  # [Q] int64 their class c
    counts: torch.Tensor  # [Q] int64 n_kc

    def client_rows(self, idx: torch.Tensor) -> FedCOFMessage:
        """The runs of clients `idx`, in that order."""
        idx = idx.to(self.pairs.device)
        start = torch.cumsum(self.pairs, 0) - self.pairs
        n = self.pairs[idx]
        first = torch.cumsum(n, 0) - n
        item = (torch.repeat_interleave(start[idx] - first, n) + torch.arange(int(n.sum()), device=n.device))
        item = item.to(self.means.device)
        return FedCOFMessage(n, self.means[item], self.classes[item], self.counts[item])

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends, averaged over the clients and rounded: per class
        it holds, its mean (D values), its label and its count."""
        M = max(int(self.pairs.shape[0]), 1)
        Q, D = self.means.shape
        per = D * self.means.element_size() + self.classes.element_size() + self.counts.element_size()
        return round(Q * (D + 2) / M), round(Q * per / M)


def pair_stats(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int, block_rows: int = 1024,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs [M], sums [Q, D] float64, classes [Q], counts [Q]) of the (client, class) pairs
    that rows of x [M, N, D] with labels y and mask true make, in (client, class) order: FedNCM's
    LocalClientStats (fedncm.client_stats) without a row for classes a client lacks. Rows are
    added in the order client_stats adds them, so each sum is its float64 sum bit for bit."""
    M, N, D = x.shape
    key = torch.where(mask, torch.arange(M, device=x.device).view(M, 1) * num_classes + y,
                      torch.full_like(y, -1)).reshape(-1)
    keys, slot = torch.unique(key, sorted=True, return_inverse=True)  # -1 (rows not sent) first
    flat = x.reshape(M * N, D)
    sums = torch.zeros(len(keys), D, dtype=torch.float64, device=x.device)
    for a in range(0, M * N, block_rows):  # float64 copies one block at a time (client_stats)
        sums.index_add_(0, slot[a:a + block_rows], flat[a:a + block_rows].to(torch.float64))
    counts = torch.bincount(slot, minlength=len(keys))
    lo = int(bool(len(keys)) and bool(keys[0] < 0))
    keys, sums, counts = keys[lo:], sums[lo:], counts[lo:]
    client = torch.div(keys, num_classes, rounding_mode="floor")
    return torch.bincount(client, minlength=M), sums, keys - client * num_classes, counts


def estimated_gram(means: torch.Tensor, cls: torch.Tensor, n: torch.Tensor, num_classes: int, gamma: float,
                   between_class: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G [D, D], class sums [C, D], class counts [C]) from the client class means [P, D] of
    classes `cls` [P] with counts `n` [P], all in float64 (float32 means are widened a block at a
    time, exactly): G = Σ_c (N_c − 1) Σ̂_c + N ḡḡᵀ (module docstring), plus
    Σ_c N_c (μ_c − ḡ)(μ_c − ḡ)ᵀ with `between_class`. `means` is read, never copied whole: the
    sums and the spread μ_kc − μ_c are formed SPREAD_ROWS rows at a time (the sums in row order,
    so bit for bit one index_add; the spread's Gram added block by block)."""
    C, D = num_classes, means.shape[1]
    nf = n.to(torch.float64)
    N_c = torch.zeros(C, dtype=torch.float64, device=means.device).index_add_(0, cls, nf)
    K_c = torch.bincount(cls, minlength=C).to(torch.float64)
    sums = torch.zeros(C, D, dtype=torch.float64, device=means.device)
    for a in range(0, means.shape[0], SPREAD_ROWS):  # Σ_k n_kc μ_kc, rows added in order
        sums.index_add_(0, cls[a:a + SPREAD_ROWS], nf[a:a + SPREAD_ROWS].unsqueeze(1) * means[a:a + SPREAD_ROWS])
    present = N_c > 0
    mu = sums / N_c.clamp(min=1).unsqueeze(1)  # exact class means
    w = nf * ((N_c - 1) / (K_c - 1).clamp(min=1))[cls]  # n_kc (N_c - 1)/(K_c - 1): both factors at once
    gram = torch.zeros(D, D, dtype=torch.float64, device=means.device)
    for a in range(0, means.shape[0], SPREAD_ROWS):
        d = mu.index_select(0, cls[a:a + SPREAD_ROWS])
        torch.sub(means[a:a + SPREAD_ROWS], d, out=d)  # the spread of the client means around their class mean
        part = (d * w[a:a + SPREAD_ROWS].unsqueeze(1)).T @ d
        gram = part if a == 0 else gram.add_(part)  # one block: the single product itself
        del d, part
    shrink = float(gamma) * float(((N_c - 1) * present).sum())  # Σ_c (N_c − 1) γI
    gram.diagonal().add_(shrink)
    N = float(N_c.sum())
    if N > 0:
        g = sums.sum(0, keepdim=True)  # N ḡ
        gram += g.T @ g / N  # N ḡḡᵀ
        if between_class:
            db = mu - g / N
            gram += (db * N_c.unsqueeze(1)).T @ db
    return gram, sums, N_c.round().to(torch.int64)


class FedCOF(AlgorithmBase):
    """FedCOF in the core's algorithm protocol (one pass, no training)."""

    name = "fedcof"
    description = ("FedCOF (Goswami et al. 2025): ridge classifier from class covariances estimated from client "
                   "class means")
    config = FedCOFConfig
    global_rule = "main"
    server_sized_fields = ("bank_means", "bank_client", "bank_class", "bank_count")  # one row per pair received
    server_client_fields = None  # the bank's rows name client positions: the engine keeps the data's order
    one_pass = True  # each client sends its statistics once
    seed_free = True  # a deterministic function of the statistics

    def __init__(self, cfg: FedCOFConfig = FedCOFConfig()) -> None:
        if cfg.dtype not in DTYPES:
            raise UserError(f"dtype={cfg.dtype!r}: must be one of {', '.join(DTYPES)}")
        if not cfg.gamma >= 0:
            raise UserError(f"gamma={cfg.gamma!r}: the shrinkage must be >= 0")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]

    def init(self, spec: DataSpec, seed: int) -> Init:
        C, D, dev = spec.num_classes, spec.dim, spec.device
        cap = torch.tensor([min(int(n), C) for n in spec.n_train], dtype=torch.int64, device=dev)

        def z(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        i64 = torch.int64
        ss = FedCOFServerState(cap, z(0, D, dtype=self.dtype), z(0, dtype=i64), z(0, dtype=i64), z(0, dtype=i64), z(C, D),
                               z(C, dtype=i64), z(C, D), z(C, dtype=torch.bool), z(dtype=torch.bool))
        return Init(FedCOFClientState(torch.zeros(spec.num_clients, dtype=torch.bool, device=dev)), ss, FedCOFBroadcast())

    def client_update(self, cs: FedCOFClientState, bc: FedCOFBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedCOFClientState, FedCOFMessage]:
        fresh = ~cs.sent.to(data.m_train.device)  # a client contributes exactly once
        pairs, sums, classes, counts = pair_stats(data.x_train, data.y_train, data.m_train & fresh.view(-1, 1),
                                                  data.num_classes)
        means = sums.div_(counts.unsqueeze(-1).to(sums.dtype))  # mu_kc (FedCOFClient), in place: one [Q, D] held
        del sums
        return FedCOFClientState(torch.ones_like(cs.sent)), FedCOFMessage(pairs, means.to(self.dtype), classes, counts)

    def server_aggregate(self, ss: FedCOFServerState, msg: FedCOFMessage,
                         ctx: RoundCtx) -> tuple[FedCOFServerState, FedCOFBroadcast]:
        C, dev = int(ss.counts.shape[0]), ss.cap.device
        part = ctx.participants.to(dev)
        pairs, cls, cnt = msg.pairs.to(dev), msg.classes.to(dev), msg.counts.to(dev)
        if pairs.shape != part.shape or int(pairs.sum()) != cls.numel():
            raise UserError(f"fedcof: a message of {pairs.numel()} clients and {cls.numel()} class means for "
                            f"{part.numel()} participants")
        i = torch.repeat_interleave(torch.arange(len(part), device=dev), pairs)  # client row of each pair
        bad = ((cls < 0) | (cls >= C) | (cnt < 1)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise UserError(f"fedcof: client {int(part[i[j]])} sent class {int(cls[j])} with count {int(cnt[j])} "
                            f"(classes are 0..{C - 1}, counts >= 1)")
        key = i * C + cls  # (client, class) pairs: strictly ascending in a well-formed message
        bad = (key[1:] <= key[:-1]).nonzero()
        if len(bad):
            j = int(bad[0]) + 1
            raise UserError(f"fedcof: client {int(part[i[j]])} sent class {int(cls[j])} twice or out of ascending order")
        if bool((pairs > ss.cap[part]).any()):
            raise UserError("fedcof: a client sent means of more classes than it has training samples")
        if not cls.numel():  # nothing new: the bank and the head stay as they are
            return ss, FedCOFBroadcast()
        # the bank keeps the means in the dtype they are sent in; estimated_gram widens each block
        means, client, cls, cnt = self._merged(ss, part[i], msg.means.to(dev, ss.bank_means.dtype), cls, cnt)
        gram, sums, counts = estimated_gram(means, cls, cnt, C, self.cfg.gamma, self.cfg.between_class)
        present = counts > 0
        sol, pinv = solve_psd(gram, sums.T, "fedcof: estimated Gram",  # W = G^-1 [N_c mu_c]
                              f" (gamma={self.cfg.gamma:g}; gamma > 0 makes it definite once a class has 2 samples)")
        del gram
        weight, _ = normalise_classes(sol.T, torch.zeros_like(sol[0]), present)
        new = FedCOFServerState(ss.cap, means, client, cls, cnt, sums, counts, weight, present,
                                torch.tensor(pinv, device=sol.device))
        return new, FedCOFBroadcast()

    @staticmethod
    def _merged(ss: FedCOFServerState, client: torch.Tensor, means: torch.Tensor, cls: torch.Tensor,
                cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bank with the new pairs (client positions `client`, class means, classes, counts)
        in (client, class) order; a client that sends again replaces its rows. Where the bank holds
        none of them yet and they come in order (one round of every client), the message's own
        tensors are the bank: nothing is copied."""
        C = int(ss.counts.shape[0])
        keep = ~torch.isin(ss.bank_client, client.unique())
        new_key = client * C + cls
        if not bool(keep.any()) and not bool((new_key[1:] <= new_key[:-1]).any()):
            return means, client, cls, cnt
        key = torch.cat([ss.bank_client[keep] * C + ss.bank_class[keep], new_key])
        order = torch.argsort(key)  # keys are distinct: the (client, class) pairs
        at = torch.empty_like(order)
        at[order] = torch.arange(len(order), device=order.device)  # each row's place in the merged bank
        kept = keep.nonzero().squeeze(1)
        out = means.new_empty((len(order), means.shape[1]))
        k = len(kept)
        for a in range(0, k, SPREAD_ROWS):  # the kept rows moved a block at a time: no copy of the bank
            b = min(a + SPREAD_ROWS, k)
            out.index_copy_(0, at[a:b], ss.bank_means.index_select(0, kept[a:b]))
        out.index_copy_(0, at[k:], means)
        return (out, torch.cat([ss.bank_client[keep], client])[order], torch.cat([ss.bank_class[keep], cls])[order],
                torch.cat([ss.bank_count[keep], cnt])[order])

    def predict(self, cs: FedCOFClientState, ss: FedCOFServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if not bool(ss.present.any()):
            raise UserError("fedcof: no class means yet (run at least one round)")
        return {"main": class_scores(ss.weight, torch.zeros_like(ss.weight[:, 0]), ss.present, x)}

    def linear_head(self, ss: FedCOFServerState) -> dict[str, torch.Tensor]:
        """The FedCOF classifier as the fine-tuning head (FedCOF+FT), bias 0 as the authors' head."""
        return linear_head(ss.weight, torch.zeros_like(ss.weight[:, 0]))

    def prototype_view(self, cs: FedCOFClientState, ss: FedCOFServerState, x: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """Inner products of x with the class weights w_c (faiss batch prediction)."""
        M = x.shape[0]
        return x, ss.weight.unsqueeze(0).expand(M, -1, -1), ss.present.unsqueeze(0).expand(M, -1), "ip"

    def secure_form(self, message: object = None) -> SecureForm:
        """Refused in one line: the estimator needs every client's own means."""
        size = ""
        if isinstance(message, FedCOFMessage):
            D = int(message.means.shape[-1])
            size = f" (D² = {D * D:,} per class here, against D = {D:,} for a mean)"
        raise UserError("secagg: fedcof needs each client's class means in the clear (its server estimates the class "
                        "covariances from their spread); the sum form, sum_k n_kc mu_kc mu_kc^T per class, would cost "
                        f"C·D² values per client{size}")

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Class means in the backbone space up: the paper counts the means of the classes a
        client holds (FedNCM's cost); without the data this convention gives the bound C x D of a
        client holding every class. The measured upload (`FedCOFMessage.comm_size`) counts the
        classes each client holds, with a label and a count per class. Down: the classifier,
        C x D, as FedNCM's Appendix A counts its head."""
        up = arch.num_classes * arch.in_dim
        return PaperRoundComm(up, up)

    def trainable_params(self, cs: FedCOFClientState) -> int:
        return 0  # nothing is trained: the classifier is computed in closed form


def _factory(**kw: object) -> FedCOF:
    return FedCOF(FedCOFConfig(**kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedcof", _factory, description=FedCOF.description, config=FedCOF.config)
