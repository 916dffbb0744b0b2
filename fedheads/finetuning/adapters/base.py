"""What the federated LoRA algorithms share: adapters on the live network (fedheads.finetuning.lora),
client SGD on the factors they train, and the server step as sums plus a finalize.

The model g(f(x; W0 + s B A); v) (Hu et al. 2022, Eq. 3; s = alpha / r) trains the factors of
the adapted layers after the cut and the linear head v; every other weight is frozen and
BatchNorm keeps its pre-trained statistics (eval mode). What a subclass chooses:

    trains    the factors each client trains ("A", "B")
    shared    the trained factors that are sent up, aggregated and broadcast; the others of
              `trains` stay with the client (its own state, `AdapterState.local`)
    local_head  the head is kept by each client too (never sent)

State keys: "lora_A:<stage>/<path>", "lora_B:<stage>/<path>" (peft's factor layouts), "head/weight",
"head/bias", FLoRA's merged weights "base:<stage>/<path>". The global model's params are what the
server aggregates (through the FT server optimiser); its buffers are the fixed parts every client
holds (FFA-LoRA's frozen A, FLoRA's merged weights), moved only by the algorithm's finalize.

Sums (what secure aggregation would reveal): S = sum_k n_k (theta_k - theta) over the shared
params, N = sum_k n_k, plus the algorithm's own sums (`extra`); finalize: Delta = S / N, then the
FT server optimiser (FedAvg: theta + Delta).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import DeltaMessage, GlobalModel
from fedheads.core import rng
from fedheads.core.config import setting
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import payload_size
from fedheads.finetuning.algorithm import FineTune, FTConfig, local_sgd
from fedheads.finetuning.lora import LoRALayer, attach_adapters
from fedheads.finetuning.model import LiveNet, Params
from fedheads.run.checks import check_finite

HEAD_KEYS = ("head/weight", "head/bias")


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA settings (`--set`); defaults from the authors' configurations."""

    rank: int = setting(8, "r, the rank of every adapter (FLoRA with `ranks`: each client's own, with alpha / r kept)",
                        source="FedSA-LoRA and FLoRA authors' configs (r=8); peft's default")
    alpha: float = setting(16.0, "LoRA alpha: updates are scaled by alpha / r (FLoRA keeps alpha / r fixed across ranks)",
                           source="FedSA-LoRA and FLoRA authors' configs (lora_alpha=16)")
    lora_dropout: float = setting(0.05, "dropout on the adapters' input (peft's lora_dropout)",
                                  source="FedIT, FedSA-LoRA and FLoRA authors' configs (0.05)")
    target_modules: str = setting("", "comma-separated fnmatch patterns over <stage>/<path> of layers after the cut "
                                  "(empty: the backbone family's default, fedheads.finetuning.lora.DEFAULT_TARGETS)")
    ranks: str = setting("", "FLoRA's heterogeneous ranks: comma-separated, client i gets ranks[i mod len] "
                         "(e.g. 4,8,16; empty: every client has `rank`)",
                         source="FLoRA authors' code: local_ranks, alpha_k = 2 r_k")
    dp_epsilon: float = setting(0.0, "client-level DP on the adapter updates: the target epsilon over the run's rounds "
                                "(0: off); each client's update clipped to dp_clip, Gaussian noise on their sum",
                                source="McMahan et al. 2018 (DP-FedAvg), fixed-denominator estimator")
    dp_delta: float = setting(1e-5, "DP delta (client-level adjacency: one client's whole data added or removed)")
    dp_clip: float = setting(0.1, "L2 bound of one client's update of the shared tensors (the clipping norm C)")

    def __post_init__(self) -> None:
        check_finite(self)
        if self.rank < 1:
            raise UserError(f"rank {self.rank}: must be at least 1")
        if self.alpha <= 0:
            raise UserError(f"alpha {self.alpha}: must be positive")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"lora_dropout {self.lora_dropout}: must be in [0, 1)")
        for r in self.rank_list():
            if r < 1:
                raise UserError(f"ranks {self.ranks!r}: every rank must be at least 1")
        if self.dp_epsilon < 0 or not 0 < self.dp_delta < 1 or self.dp_clip <= 0:
            raise UserError(f"dp_epsilon {self.dp_epsilon} / dp_delta {self.dp_delta} / dp_clip {self.dp_clip}: "
                            "epsilon >= 0 (0: off), 0 < delta < 1, clip > 0")

    def rank_list(self) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in str(self.ranks).split(",") if v.strip())
        except ValueError:
            raise UserError(f"ranks {self.ranks!r}: comma-separated whole numbers, e.g. 4,8,16") from None

    def client_rank(self, client: int) -> int:
        rl = self.rank_list()
        return rl[client % len(rl)] if rl else self.rank


@dataclass(frozen=True)
class AdapterState:
    model: GlobalModel  # the shared state (params aggregated; buffers fixed or merged)
    opt: Any  # the server optimiser's state over model.params
    local: Params  # the clients' own tensors, [M, ...] (never sent; in a deployment each client holds its row)
    stats: Params  # scalars of the last round for its record (e.g. FedIT's aggregation gap)


@dataclass(frozen=True)
class AdapterSums:
    delta: Params  # sum_k n_k (theta_k - theta) over model.params
    weight: torch.Tensor  # sum_k n_k (float64 scalar)
    extra: Params  # the algorithm's own sums


class AdapterFT(FineTune):
    """The LoRA family's common client and server steps (module docstring)."""

    name = ""
    summary = ""
    trains: tuple[str, ...] = ("A", "B")
    shared: tuple[str, ...] = ("A", "B")
    local_head = False
    dp_supported = True  # client-level DP on the sum of the shared deltas (FLoRA's stacks are no such sum)

    def __init__(self, cfg: FTConfig | None = None, acfg: AdapterConfig = AdapterConfig()) -> None:
        super().__init__(cfg or FTConfig())
        self.acfg = acfg
        self.layers: dict[str, LoRALayer] = {}
        self.num_clients = 0
        self._local0: Params = {}
        self.noise_multiplier = 0.0  # z of the client-level Gaussian mechanism (0: no DP)
        self.privacy: dict[str, Any] | None = None  # the privacy block of results.json (`privatise`)

    @property
    def personalised(self) -> bool:
        return self.local_head or bool(set(self.trains) - set(self.shared))

    # ------------------------------------------------------------------ the network
    def attach(self, net: LiveNet, backbone: str, seed: int, num_clients: int) -> GlobalModel:
        """Put adapters on the target layers after the cut (A drawn from `seed`), freeze the rest;
        returns the starting global model (B = 0: the pre-trained network with its stage-1 head)."""
        if net.trainable.mode == "head":
            raise UserError(f"adapter={self.name}: adapters need stages to adapt; use trainable=after:BLOCK or all")
        a = self.acfg
        gen = torch.Generator().manual_seed(int(rng.hash_keys(seed, 0x10A)))
        self.layers = attach_adapters(net.staged, net.trained_stages, backbone, rank=a.rank, alpha=a.alpha,
                                      dropout=a.lora_dropout, target_modules=a.target_modules, generator=gen)
        for name, layer in self.layers.items():
            for r in set(a.rank_list()):
                if not 1 <= r <= min(layer.in_dim, layer.out_dim):
                    raise UserError(f"ranks {a.ranks!r}: rank {r} exceeds the width of {name} "
                                    f"({layer.in_dim} -> {layer.out_dim})")
        net.bn = "frozen"  # the base is frozen: BatchNorm keeps its pre-trained statistics
        self.num_clients = num_clients
        return self.start_model(net)

    @staticmethod
    def key(name: str, factor: str) -> str:
        return f"lora_{factor}:{name}"

    def read(self, net: LiveNet) -> Params:
        """Every adapter factor and the head, detached (views: clone to keep)."""
        out = {"head/weight": net.head.weight.detach(), "head/bias": net.head.bias.detach()}
        for n, layer in self.layers.items():
            out[self.key(n, "A")], out[self.key(n, "B")] = layer.lora_A.detach(), layer.lora_B.detach()
        return out

    @torch.no_grad()
    def load(self, net: LiveNet, model: GlobalModel) -> None:
        """Write a model (global or a client's view) into the network; an adapter whose B the model
        lacks contributes nothing (B = 0)."""
        state = {**model.params, **model.buffers}
        for k in HEAD_KEYS:
            getattr(net.head, k.split("/")[1]).copy_(state[k])
        for n, layer in self.layers.items():
            if f"base:{n}" in state:
                layer.base.weight.copy_(state[f"base:{n}"])
            for f in ("A", "B"):
                p = layer.lora_A if f == "A" else layer.lora_B
                v = state.get(self.key(n, f))
                if v is None:
                    if f == "B":
                        p.zero_()
                    continue
                if p.shape != v.shape:  # another rank (FLoRA's clients)
                    setattr(layer, f"lora_{f}", torch.nn.Parameter(v.detach().clone()))
                else:
                    p.copy_(v)

    def start_model(self, net: LiveNet) -> GlobalModel:
        s = self.read(net)
        params = {} if self.local_head else {k: s[k].clone() for k in HEAD_KEYS}
        buffers = {}
        for n in self.layers:
            for f in ("A", "B"):
                if f in self.shared:
                    params[self.key(n, f)] = s[self.key(n, f)].clone()
                elif f not in self.trains:  # fixed at its initialisation, held by every client
                    buffers[self.key(n, f)] = s[self.key(n, f)].clone()
        self._local0 = {k: s[k].clone() for k in self.local_keys()}
        return GlobalModel(params, buffers)

    def local_keys(self) -> list[str]:
        keys = [self.key(n, f) for n in self.layers for f in self.trains if f not in self.shared]
        return keys + (list(HEAD_KEYS) if self.local_head else [])

    def trained_values(self, net: LiveNet) -> int:
        """Values a client trains: its factors and the head."""
        return sum(int(p.numel()) for p in self.trained_params(net))

    def trained_params(self, net: LiveNet) -> list[torch.nn.Parameter]:
        out = [net.head.weight, net.head.bias]
        for layer in self.layers.values():
            out += [layer.lora_A] if "A" in self.trains else []
            out += [layer.lora_B] if "B" in self.trains else []
        return out

    # ------------------------------------------------------------------ state
    def init(self, start: GlobalModel) -> AdapterState:  # type: ignore[override]
        local = {k: v.unsqueeze(0).repeat(self.num_clients, *([1] * v.dim())) for k, v in self._local0.items()}
        return AdapterState(start, self.server_opt.init(start.params), local, self._stats(self.stats_init(), 0.0))

    def stats_init(self) -> Params:
        return {}

    def _stats(self, own: Params, clipped_fraction: float) -> Params:
        dp = {"dp_clipped_fraction": torch.tensor(clipped_fraction, dtype=torch.float64)} if self.noise_multiplier else {}
        return {**own, **dp}

    # ------------------------------------------------------------------ client-level differential privacy
    def privatise(self, rounds: int) -> dict[str, Any] | None:
        """Calibrate the noise multiplier z for the run (`acfg.dp_epsilon` > 0) and return the
        privacy block of results.json (None without DP).

        DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR
        2018, Alg. 1 with the fixed-denominator estimator): each participant's update of the shared
        tensors is clipped to L2 norm C (dp_clip) and counted with weight 1 (not n_k, whose size
        would reveal the client); the server adds N(0, (z C)^2) to every entry of the sum and divides
        by the number of participants. One round is one Gaussian release of sensitivity C for the
        adjacency "one client added or removed"; a client is in at most `rounds` of them, and the
        accountant (fedheads.privacy_accounting, RDP) composes `rounds` releases: no amplification by
        the sampling of participants is claimed. The noise is drawn from the run's seed, so a run
        reproduces; a deployment draws it from a secret."""
        a = self.acfg
        if a.dp_epsilon <= 0:
            return None
        if not self.dp_supported:
            raise UserError(f"adapter={self.name}: client-level DP works on sums of the shared updates; "
                            f"{self.name} sends new factors every round (use lora, ffa-lora or fedsa-lora)")
        from fedheads.privacy_accounting import calibrate, epsilon

        releases = max(int(rounds), 1)
        self.noise_multiplier = calibrate(a.dp_epsilon, a.dp_delta, releases)
        self.privacy = {"mechanism": "Gaussian on the sum of clipped client updates (DP-FedAvg, fixed denominator)",
                "adjacency": "one client (client-level)", "epsilon": epsilon(self.noise_multiplier, a.dp_delta, releases),
                "target_epsilon": a.dp_epsilon, "delta": a.dp_delta, "clip": a.dp_clip,
                "noise_multiplier": self.noise_multiplier, "noise_std": self.noise_multiplier * a.dp_clip,
                "releases": releases, "accountant": "rdp", "sampling_amplification": False}
        return self.privacy

    def _clipped(self, msg: DeltaMessage, shared: Params) -> tuple[DeltaMessage, int]:
        """Each client's update of the shared tensors scaled to L2 norm <= C, weight 1."""
        C = self.acfg.dp_clip
        keys = [k for k in msg.delta if k in shared]
        M = int(msg.weight.shape[0])
        norms = torch.zeros(M, dtype=torch.float64, device=msg.weight.device)
        for k in keys:
            norms += msg.delta[k].double().flatten(1).pow(2).sum(1)
        norms = norms.sqrt()
        f = torch.clamp(C / torch.clamp(norms, min=1e-300), max=1.0)
        delta = {k: v * f.to(v.dtype).view(-1, *([1] * (v.dim() - 1))) if k in shared else v
                 for k, v in msg.delta.items()}
        return DeltaMessage(delta, {}, torch.ones_like(msg.weight)), int((norms > C).sum())

    def client_start(self, ss: AdapterState, client: int) -> GlobalModel:
        """What client `client` starts its round from: the broadcast plus its own kept tensors."""
        if not ss.local:
            return ss.model
        return GlobalModel(ss.model.params, {**ss.model.buffers, **{k: v[client] for k, v in ss.local.items()}})

    eval_model = client_start  # a personalised model is evaluated per client with its own tensors

    def client_keep(self, ss: AdapterState, client: int, net: LiveNet) -> AdapterState:
        """The client keeps its own tensors after training (in its row of `local`, in place)."""
        if ss.local:
            now = self.read(net)
            with torch.no_grad():
                for k, v in ss.local.items():
                    v[client].copy_(now[k])
        return ss

    def down_size(self, ss: AdapterState) -> tuple[int, int]:
        """(values, bytes) broadcast to one client per round: the aggregated params (buffers are
        fixed: derived from the shared seed, or merged by the clients themselves)."""
        return payload_size(ss.model.params, per_client=False)

    # ------------------------------------------------------------------ client
    def prepare(self, net: LiveNet, bc: GlobalModel, ctx: RoundCtx, client: int) -> None:
        self.load(net, bc)

    def client_update(self, bc: GlobalModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],  # type: ignore[override]
                      n_train: int, ctx: RoundCtx, net: LiveNet, client: int = -1) -> DeltaMessage:
        """E local epochs of client SGD on the trained factors and the head from `bc`; the message
        holds the change of the shared params only, weight n_k (client axis of 1)."""
        self.prepare(net, bc, ctx, client)
        net.train_mode()
        params = self.trained_params(net)
        for layer in self.layers.values():
            layer.lora_A.requires_grad_("A" in self.trains)
            layer.lora_B.requires_grad_("B" in self.trains)
        net.head.requires_grad_(True)
        local_sgd(self.cfg, net, params, batches, ctx.round, net.head.weight.device)
        return self.message(bc, net, n_train)

    def message(self, bc: GlobalModel, net: LiveNet, n_train: int) -> DeltaMessage:
        now = self.read(net)
        dev = net.head.weight.device
        return DeltaMessage({k: (now[k] - v).unsqueeze(0) for k, v in bc.params.items()}, {},
                            torch.tensor([float(n_train)], dtype=torch.float64, device=dev))

    # ------------------------------------------------------------------ server
    def sums_init(self, ss: AdapterState, ctx: RoundCtx | None = None) -> AdapterSums:  # type: ignore[override]
        dev = ss.model.params[HEAD_KEYS[0]].device if HEAD_KEYS[0] in ss.model.params else \
            next(iter(self.layers.values())).lora_A.device
        return AdapterSums({k: torch.zeros_like(v) for k, v in ss.model.params.items()},
                           torch.zeros((), dtype=torch.float64, device=dev), self.extra_init(ss, ctx))

    def extra_init(self, ss: AdapterState, ctx: RoundCtx | None) -> Params:
        return {}

    def sums_add(self, sums: AdapterSums, msg: DeltaMessage) -> AdapterSums:  # type: ignore[override]
        """S += n_k delta_k over the message's client axis (in place, returned); under DP the
        clipped deltas with weight 1 (`privatise`)."""
        if self.noise_multiplier:
            msg, clipped = self._clipped(msg, sums.delta)
            sums.extra["dp_clipped"] = sums.extra.get("dp_clipped", torch.zeros((), dtype=torch.int64)) + clipped
        w = msg.weight
        for k, d in msg.delta.items():
            if k in sums.delta:
                sums.delta[k].add_((w.to(d.dtype).view(-1, *([1] * (d.dim() - 1))) * d).sum(0))
        self.extra_add(sums, msg)
        return replace(sums, weight=sums.weight + w.sum())

    def extra_add(self, sums: AdapterSums, msg: DeltaMessage) -> None:
        pass

    def server_finalize(self, ss: AdapterState, sums: AdapterSums,  # type: ignore[override]
                        ctx: RoundCtx) -> tuple[AdapterState, GlobalModel]:
        """Delta = S / N; the FT server optimiser on the shared params; the algorithm's own
        finalize (`finalize_extra`) on the buffers and round statistics."""
        if float(sums.weight) <= 0:
            return ss, ss.model
        n = sums.weight
        S = sums.delta
        if self.noise_multiplier:  # N(0, (z C)^2) on every entry of the sum, drawn from (seed, round, tensor)
            from fedheads.privacy import gaussian

            std = self.noise_multiplier * self.acfg.dp_clip
            S = {k: v + (std * gaussian(v.shape, (ctx.seed, ctx.round, i, 0xD9A), v.device)).to(v.dtype)
                 for i, (k, v) in enumerate(sorted(S.items()))}
        delta = {k: v / n.to(v.dtype) for k, v in S.items()}
        params, opt = self.server_opt.step(ss.model.params, delta, ss.opt)
        buffers, stats = self.finalize_extra(ss, sums, params)
        clipped = float(sums.extra.get("dp_clipped", 0)) / float(n) if self.noise_multiplier else 0.0
        model = GlobalModel(params, buffers)
        return AdapterState(model, opt, ss.local, self._stats(stats, clipped)), model

    def finalize_extra(self, ss: AdapterState, sums: AdapterSums, params: Params) -> tuple[Params, Params]:
        return dict(ss.model.buffers), ss.stats

    def server_aggregate(self, ss: AdapterState, msg: DeltaMessage, ctx: RoundCtx) -> tuple[AdapterState, GlobalModel]:
        return self.server_finalize(ss, self.sums_add(self.sums_init(ss, ctx), msg), ctx)

    # ------------------------------------------------------------------ export
    @torch.no_grad()
    def merge_into(self, net: LiveNet) -> None:
        """Fold every adapter into its base layer and remove it (the network then holds plain
        layers: W0 + s B A), for the exported backbone."""
        for name, layer in self.layers.items():
            stage, _, path = name.partition("/")
            parent_path, _, attr = path.rpartition(".")
            root = net.staged.stage(stage)
            parent = root.get_submodule(parent_path) if parent_path else root
            setattr(parent, attr, layer.merged())
