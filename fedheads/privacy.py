"""Differential privacy for the training-free heads: per-example clipping and the Gaussian
mechanism on the secure sums (or, in local mode, on each client's own statistics). How the noise
is divided between the statistics (sigma_f) and what epsilon it buys: fedheads.privacy_accounting.

Any algorithm with a secure form (`AlgorithmBase.secure_form`: which message fields are sums
and how the server turns totals into its state) and DP sensitivities (`dp_sensitivity(clip)`:
each sum field's L2 sensitivity to one example whose feature has norm <= clip) is made private
by :class:`Private`, without touching its file. The recipe (Dwork & Roth, "The Algorithmic
Foundations of Differential Privacy", Sec. 3.5.3 and Appendix A, the Gaussian mechanism):

1. each client scales every training feature x to ``x * min(1, C/||x||)`` ("clip") or to
   ``x * C/||x||`` ("normalize"), so one example moves each sum field f by at most Delta_f;
2. the sums are formed as the algorithm forms them (per client, then added: SecAgg+ can add them);
3. Gaussian noise N(0, sigma_f^2 I) is added to the TOTAL of every field f, once per round:
   by the server ("central"), or as N(0, sigma_f^2 / K I) by each of the round's K participants
   ("distributed": the shares add up to sigma_f^2 under SecAgg+, and the server adds none);
   sigma_f = z * Delta_f / sqrt(w_f) makes the round one Gaussian mechanism of noise
   multiplier z (fedheads.privacy_accounting);
4. the server finalizes from the noisy totals (the secure form's `aggregate`), which is
   post-processing (Dwork & Roth, Prop. 2.1): the algorithm may adapt that step to the noise
   it is told of (`RoundCtx.noise_std`: Fed3R's ridge penalty; `AlgorithmBase.dp_finalize`
   reports what it makes of it in results.json's `post_processing`).

Noise is drawn from a secret key: `noise_seed=None` (default) takes a fresh one from the OS, as a
deployment must (noise a reader can recompute protects nothing); an integer makes runs
reproducible for simulation and tests (the draws also depend on the run's seed, so the seeds of a
run get different noise).

Local mode ("local", for algorithms whose messages are no sums but have a local form,
`AlgorithmBase.local_form`: FedPFT's per-client class Gaussians): each client adds
N(0, sigma_f^2 I) to each field f of ITS OWN statistics, sigma_f as above, and builds its message
from the noisy statistics (post-processing); the server receives only that. An example is in its
client's statistics only, released once by a one-shot head: one Gaussian mechanism of multiplier
z, accounted as a round's totals are (Analyze Gauss, Dwork, Talwar, Thakurta & Zhang,
"Analyze Gauss: Optimal Bounds for Privacy-Preserving Principal Component Analysis", STOC 2014,
applies it to a second moment matrix). The guarantee holds against the server too, at the price
of K noise draws in what the server combines instead of one.

Not covered: the evaluation on clients' test splits (it releases accuracies, not statistics);
distributed noise against fewer honest clients than planned (dropped-out clients, or t clients
colluding with the server to subtract their shares, leave sigma_f^2 * (K - t) / K in the sum);
floating-point attacks on the sampler (Mironov, "On Significance of the Least Significant Bits
for Differential Privacy", CCS 2012).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm
from fedheads.core.tree import tree_cat, tree_rows
from fedheads.privacy_accounting import (  # noqa: F401 (Mechanism: also importable from here)
    ACCOUNTANTS,
    MAX_EPSILON,
    MODES,
    TRANSFORMS,
    Mechanism,
    calibrate,
    epsilon,
    noise_stds,
    pld_interval,
)


# ---------------------------------------------------------------------- clipping and noise
def bound_rows(x: torch.Tensor, mask: torch.Tensor, clip: float, transform: str = "clip") -> torch.Tensor:
    """Rows of x [..., N, D] (mask [..., N] True for real rows) scaled to L2 norm <= clip
    ("clip") or == clip ("normalize"; an all-zero row stays zero). Computed in float64."""
    x64 = x.to(torch.float64)
    norm = x64.norm(dim=-1, keepdim=True)
    safe = norm.clamp_min(torch.finfo(torch.float64).tiny)
    factor = (clip / safe).clamp(max=1.0) if transform == "clip" else torch.where(norm > 0, clip / safe, 0.0)
    out = torch.where(mask.unsqueeze(-1), x64 * factor, x64)
    return out.to(x.dtype)


def bounded(data: FedData, clip: float, transform: str) -> FedData:
    """`data` with every training feature (and stored augmented view) bounded by `bound_rows`."""
    v = data.v_train
    if v is not None:
        v = bound_rows(v, data.m_train.unsqueeze(1).expand(v.shape[:-1]), clip, transform)
    return dataclasses.replace(data, x_train=bound_rows(data.x_train, data.m_train, clip, transform), v_train=v)


def gaussian(shape: Sequence[int], key: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Standard normal float64 noise from a 64-bit seed derived from the integer `key`
    (numpy's SeedSequence hash), so a draw is a pure function of (secret, round, client, field)."""
    import numpy as np

    seed = int(np.random.SeedSequence([int(k) & (2**63 - 1) for k in key]).generate_state(1, np.uint64)[0])
    g = torch.Generator(device="cpu")
    g.manual_seed(seed & (2**63 - 1))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)


# ---------------------------------------------------------------------- the wrapper
@dataclass(frozen=True)
class PrivateClientState:
    inner: Any  # the algorithm's own client state
    releases: torch.Tensor  # [M] int64: rounds in which this client sent non-zero statistics


@dataclass(frozen=True)
class PrivateMessage:
    """A client's contributions to the secure sums (client axis first; float64; with its noise
    share in distributed mode) and what the algorithm sends in the clear (None: nothing)."""

    sums: dict[str, torch.Tensor]
    clear: Any = None


def plain_client_state(cs: Any) -> Any:
    """The algorithm's own client state (what `fedheads predict` rebuilds) of a private run's."""
    return cs.inner if isinstance(cs, PrivateClientState) else cs


# AlgorithmBase declarations that describe the message or the client state's layout, which Private
# replaces with its secure-sum form (PrivateMessage) and PrivateClientState: they stay Private's own
OWN_ATTRIBUTES = ("sums_messages", "update_replaces")


def delegated_attributes() -> tuple[str, ...]:
    """The class attributes AlgorithmBase declares (name, rules, state-field lists, flags), less
    OWN_ATTRIBUTES: what Private takes from the algorithm it wraps, so a declaration added to
    the protocol is passed on without a change here."""
    return tuple(k for k in inspect.get_annotations(AlgorithmBase) if k not in OWN_ATTRIBUTES)


class Private(AlgorithmBase):
    """`inner` under the Gaussian mechanism `mech` (module docstring). States and predictions are
    the inner algorithm's (the client state carries a release count beside them); the message
    is the secure-sum form, so the same object runs in simulation and under SecAgg+ (local mode:
    the inner algorithm's own message, built on each client from its noisy statistics).

    Noisy totals of the integer fields of the secure form (counts) are clamped to >= 1 before the
    algorithm finalizes (post-processing, no privacy cost): FedNCM then divides by a positive
    count and never loses a class to noise (a count pushed to <= 0 would flag it absent, and with
    strong noise every class), at the price that a class no client holds is present with a mean
    of pure noise (under DP, presence is itself a statistic of the data: only the noisy counts
    may decide it). With no noise the head is the plain one, except for such a class. The clamp
    is per round: under partial participation over R rounds a class no fresh client holds in a
    round still gains a count of 1 there (up to R in all; FedNCM's cosine rule ignores counts).
    An algorithm that declares `clamp_noisy_counts = False` gets the raw noisy counts (CCVR, Fed3R).

    Features are bounded for training only: the head is evaluated, and served by `fedheads
    predict`, on the features as stored."""

    def __init__(self, inner: AlgorithmBase, mech: Mechanism) -> None:
        if isinstance(inner, Private):
            raise UserError(f"dp: {inner.name} is already private")
        self.sensitivity = {k: float(v) for k, v in inner.dp_sensitivity(mech.clip).items()}  # refuses in one line
        if mech.mode == "local":
            inner.local_form()  # the per-client statistics the noise goes on (refuses in one line)
        else:
            try:
                inner.secure_form()  # the sums the noise goes on (refuses in one line)
            except UserError as e:
                if type(inner).local_form is AlgorithmBase.local_form:
                    raise
                raise UserError(f"{e}; under DP use --dp-mode local") from None
        bad = [k for k, v in self.sensitivity.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise UserError(f"dp: {inner.name}'s sensitivity of {bad[0]} is {self.sensitivity[bad[0]]}")
        self.inner, self.mech = inner, mech
        self.cfg = inner.cfg
        for k in delegated_attributes():  # the states are the inner algorithm's: so are its declarations
            setattr(self, k, getattr(inner, k))
        self.z = mech.z()
        self.noise_std = noise_stds(self.sensitivity, self.z, mech.split)
        self._secret = secrets.randbits(63) if mech.noise_seed is None else int(mech.noise_seed)
        self.post_processing: dict[str, Any] = {}  # the inner finalize's choices under this noise (dp_finalize)

    # ------------------------------------------------------------------ protocol
    def init(self, spec: DataSpec, seed: int) -> Init:
        self.post_processing = self.inner.dp_finalize(dict(self.noise_std), spec)
        it = self.inner.init(spec, seed)
        rel = torch.zeros(spec.num_clients, dtype=torch.int64, device=spec.device)
        return Init(PrivateClientState(it.client_state, rel), it.server_state, it.broadcast)

    def client_update(self, cs: PrivateClientState, bc: Any, data: FedData, ctx: RoundCtx,
                      ) -> tuple[PrivateClientState, Any]:
        data = bounded(data, self.mech.clip, self.mech.transform)
        if self.mech.mode == "local":
            return self._local_update(cs, bc, data, ctx)
        inner_cs, msg = self.inner.client_update(cs.inner, bc, data, ctx)
        form = self.inner.secure_form(msg)
        M = data.num_clients
        rows = [tree_rows(msg, [i]) for i in range(M)]
        contrib = [form.sums(r) for r in rows]
        if contrib[0] and set(contrib[0]) != set(self.sensitivity):  # {}: nothing released this round
            raise UserError(f"dp: {self.name}'s secure sums ({', '.join(sorted(contrib[0]))}) do not match its "
                            f"sensitivities ({', '.join(sorted(self.sensitivity))})")
        sums = {k: torch.stack([c[k].to(torch.float64) for c in contrib]) for k in contrib[0]}
        sent = torch.zeros(M, dtype=torch.bool, device=data.device)
        for v in sums.values():
            sent |= (v.reshape(M, -1) != 0).any(1).to(sent.device)
        clears = [form.clear(r) for r in rows]
        clear = None if clears[0] is None else tree_cat(clears)
        if self.mech.mode == "distributed":  # each participant's share: N(0, sigma_f^2 / K)
            K = len(ctx.participants)
            share = {k: s / math.sqrt(K) for k, s in self.noise_std.items()}
            sums = self._client_noise(sums, share, 1, data, ctx)
        rel = cs.releases + sent.to(cs.releases.device, torch.int64)
        return PrivateClientState(inner_cs, rel), PrivateMessage(sums, clear)

    def _local_update(self, cs: PrivateClientState, bc: Any, data: FedData, ctx: RoundCtx) -> tuple[PrivateClientState, Any]:
        """Local mode: each releasing client noises its own statistics, then builds its message."""
        form = self.inner.local_form()
        inner_cs, stats, release = form.stats(cs.inner, bc, data, ctx)
        if set(stats) != set(self.sensitivity):
            raise UserError(f"dp: {self.name}'s local statistics ({', '.join(sorted(stats))}) do not match its "
                            f"sensitivities ({', '.join(sorted(self.sensitivity))})")
        noisy = self._client_noise(stats, self.noise_std, 2, data, ctx, on=release)
        msg = form.message(noisy, release, data, ctx)
        rel = cs.releases + release.to(cs.releases.device, torch.int64)
        return PrivateClientState(inner_cs, rel), msg

    def _client_noise(self, stats: dict[str, torch.Tensor], std: Mapping[str, float], stream: int, data: FedData,
                      ctx: RoundCtx, on: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`stats` (client axis first) in float64, each field k plus std[k] * N(0, I) on every
        client row (`on` [M]: only on the rows where it is True), each row's draw keyed by (secret,
        run seed, `stream`, round, the client's global id, k's place in sorted order): a client's
        noise does not depend on which clients share its stack."""
        ids = data.client_index.tolist()
        out = {k: v.to(torch.float64) for k, v in stats.items()}
        for j, k in enumerate(sorted(out)):
            if std[k] > 0:
                v = out[k]
                noise = torch.stack([gaussian(v.shape[1:], (self._secret, ctx.seed, stream, ctx.round, c, j), v.device)
                                     for c in ids])
                noise = std[k] * noise
                if on is not None:
                    noise = noise * on.to(v.device, torch.float64).view(-1, *([1] * (v.dim() - 1)))
                out[k] = v + noise
        return out

    def server_aggregate(self, ss: Any, msg: Any, ctx: RoundCtx) -> tuple[Any, Any]:
        if self.mech.mode == "local":  # the clients' messages, built from their noisy statistics
            return self.inner.server_aggregate(ss, msg, ctx)
        totals = {k: v.sum(0) for k, v in msg.sums.items()}
        return self._aggregate(ss, msg.clear, totals, ctx)

    def _aggregate(self, ss: Any, clear: Any, totals: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple[Any, Any]:
        form = self.inner.secure_form(clear)
        totals = dict(totals)
        if self.mech.mode == "central":  # the server's noise, once per round on the totals
            for j, k in enumerate(sorted(totals)):
                t = totals[k].to(torch.float64)
                if self.noise_std[k] > 0:
                    t = t + self.noise_std[k] * gaussian(t.shape, (self._secret, ctx.seed, 0, ctx.round, j), t.device)
                totals[k] = t
        for k in form.integer if self.inner.clamp_noisy_counts else ():
            if k in totals:
                totals[k] = totals[k].clamp_min(1)
        noisy = dataclasses.replace(ctx, noise_std={k: self.noise_std[k] for k in totals})  # for the finalize to adapt to
        return form.aggregate(ss, clear, totals, noisy)

    def secure_form(self, message: Any = None) -> SecureForm:
        """Under SecAgg+ the nodes' sums are PrivateMessage.sums (noisy in distributed mode: no
        longer integers); the server's step is the noise (central mode) and the inner finalize.
        Local mode: the inner algorithm's own form (its messages are already noisy)."""
        if self.mech.mode == "local":
            return self.inner.secure_form(message)
        inner = self.inner.secure_form(None if message is None else message.clear)
        integer = inner.integer if self.mech.mode == "central" else ()

        def clear(m: PrivateMessage) -> PrivateMessage | None:
            return None if m.clear is None else PrivateMessage({}, m.clear)

        def agg(ss: Any, cl: Any, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple[Any, Any]:
            return self._aggregate(ss, None if cl is None else cl.clear, tot, ctx)

        return SecureForm(lambda m: {k: v[0] for k, v in m.sums.items()}, integer, clear, agg)

    def predict(self, cs: PrivateClientState, ss: Any, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.predict(cs.inner, ss, x, mask)

    def trainable_params(self, cs: PrivateClientState) -> int:
        return self.inner.trainable_params(cs.inner)

    def adapt_for_eval(self, cs: PrivateClientState, ss: Any, data: FedData) -> PrivateClientState:
        out = self.inner.adapt_for_eval(cs.inner, ss, data)  # the engine takes an override's result as it is
        return cs if out is None else PrivateClientState(out, cs.releases)

    def prototype_view(self, cs: PrivateClientState, ss: Any, x: torch.Tensor) -> Any:
        return self.inner.prototype_view(cs.inner, ss, x)

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm | None:
        return self.inner.paper_round_comm(arch, clients)

    def linear_head(self, server_state: Any) -> dict[str, torch.Tensor] | None:
        return self.inner.linear_head(server_state)  # the server state is the inner algorithm's

    def saved_runs(self) -> dict[str, tuple[str, int | None]]:
        return self.inner.saved_runs()

    def use_saved(self, key: str, run: Any) -> None:
        self.inner.use_saved(key, run)

    def trained_notes(self, server_state: Any, classes: list[str]) -> list[str]:
        return self.inner.trained_notes(server_state, classes)

    # ------------------------------------------------------------------ accounting
    def releases(self, cs: PrivateClientState) -> int:
        """The most rounds in which any one client sent non-zero statistics."""
        return int(cs.releases.max()) if cs.releases.numel() else 0

    def report(self, releases_per_seed: Sequence[int]) -> dict[str, Any]:
        """results.json's `privacy` block for the seeds' runs (their release counts)."""
        m = self.mech
        r = max(releases_per_seed, default=0)
        eps = epsilon(self.z, m.delta, r, m.accountant)
        out: dict[str, Any] = {
            "mechanism": "gaussian", "mode": m.mode, "transform": m.transform, "clip": m.clip,
            "adjacency": "add or remove one example", "accountant": m.accountant, "delta": m.delta,
            "noise_multiplier": self.z, "target_epsilon": m.epsilon,
            "sensitivity": self.sensitivity, "noise_std": self.noise_std,
            "budget_split": {k: (self.z * self.sensitivity[k] / s) ** 2 for k, s in self.noise_std.items() if s > 0},
            "releases_per_example": r, "planned_releases": m.releases, "epsilon": eps,
            "epsilon_all_seeds": epsilon(self.z, m.delta, sum(releases_per_seed), m.accountant),
            "noise_seed": "secret" if m.noise_seed is None else m.noise_seed,
        }
        if self.post_processing:
            out["post_processing"] = self.post_processing
        worst = max(eps, out["epsilon_all_seeds"])
        if not (math.isfinite(worst) and worst <= MAX_EPSILON):  # strict JSON writes an infinite epsilon as null
            out["guarantee"] = (f"none: noise multiplier {self.z:g} spends epsilon {worst:g} (above {MAX_EPSILON:g}), "
                                "a release that protects nothing")
        if m.accountant == "pld":
            out["pld_value_discretization_interval"] = pld_interval(self.z, max(r, 1))
        if m.mode == "distributed":
            out["noise_std_per_client"] = "noise_std / sqrt(K), K = the round's participants"
        if m.mode == "local":
            out["noise_std_per_client"] = "noise_std, on each client's own statistics (local DP)"
        return out
