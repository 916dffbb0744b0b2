"""The network trained live: a frozen prefix (optional) -> the trainable stages -> a linear head.

FedNCM paper (Legate et al., "Guiding The Last Layer in Federated Learning with Pre-Trained
Models", NeurIPS 2023), Sec. 3.1: the model is g(f(x; w); v) with f the pre-trained base and g a
linear task head. The `trainable` setting says which part of f trains (the rest stays frozen):

    all          every stage of f and the head (the paper's FT);
    after:CUT    the stages after CUT and the head; the frozen prefix (stages up to CUT) is
                 either read from the feature store as cached activation maps (cache-first, the
                 default: no live pass through the prefix at all) or run live in eval mode;
    head         the head only, on the pooled features (cached or live).

The state that travels between clients and server (and is averaged) is the state_dict of the
trainable stages plus the head: parameters AND floating BatchNorm buffers. `bn="train"` trains
BatchNorm as the paper's code does (FLSim puts the model in `.train()`: batch statistics in the
forward pass, running statistics updated); `bn="frozen"` keeps BatchNorm in eval mode with the
pre-trained running statistics (its affine weights still train). The frozen prefix always runs
in eval mode with no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from embedcache.errors import UserError

Params = dict[str, torch.Tensor]
BN_MODES = ("train", "frozen")


@dataclass(frozen=True)
class Trainable:
    """Which part of the network trains (`--set trainable=all|after:CUT|head`)."""

    mode: str  # "all" | "after" | "head"
    cut: str | None = None  # the last frozen stage for mode "after"

    @staticmethod
    def parse(spec: str) -> Trainable:
        kind, _, cut = spec.partition(":")
        if kind == "after" and cut:
            return Trainable("after", cut)
        if kind in ("all", "head") and not cut:
            return Trainable(kind)
        raise UserError(f"trainable {spec!r}: use all, head or after:BLOCK (e.g. after:layer2)")

    def check(self, staged: nn.Module) -> Trainable:
        """UserError naming the cut points when the backbone has no such cut."""
        if self.mode == "after" and self.cut not in staged.cut_points():
            raise UserError(f"trainable after:{self.cut}: {staged.name} has no cut {self.cut!r} "
                            f"(cut points: {', '.join(staged.cut_points()) or 'none'})")
        return self

    @property
    def spec(self) -> str:
        return f"after:{self.cut}" if self.mode == "after" else self.mode

    def input_backbone(self, backbone: str) -> str:
        """Store name of the cached inputs of this mode: `B@CUT` maps, or `B` pooled features."""
        return f"{backbone}@{self.cut}" if self.mode == "after" else backbone


class LiveNet(nn.Module):
    """prefix (frozen) -> trainable stages -> nn.Linear head, on one device.

    `forward(x)` takes what this net's inputs are: images when the prefix runs live (or when
    everything trains), cached activation maps after the cut, or pooled features for `head`.
    """

    def __init__(self, staged: nn.Module, trainable: Trainable, num_classes: int, *,
                 bn: str = "train", live_prefix: bool = False) -> None:
        super().__init__()
        if bn not in BN_MODES:
            raise UserError(f"bn {bn!r}: use train or frozen")
        trainable.check(staged)
        self.trainable, self.bn, self.live_prefix = trainable, bn, live_prefix
        self.staged = staged
        names = list(staged.stage_names)
        if trainable.mode == "all":
            first = 0
        elif trainable.mode == "after":
            first = names.index(trainable.cut) + 1
        else:
            first = len(names)
        self.trained_stages = tuple(names[first:])
        self.frozen_stages = tuple(names[:first])
        # where a cached input enters: after the cut (maps) or after the last stage (features)
        self.start = None if trainable.mode == "all" else (trainable.cut if trainable.mode == "after" else names[-1])
        self.head = nn.Linear(int(staged.feature_dim), int(num_classes))
        for name in self.frozen_stages:
            staged.stage(name).requires_grad_(False)
        for name in self.trained_stages:
            staged.stage(name).requires_grad_(True)

    @property
    def takes_images(self) -> bool:
        return self.start is None or self.live_prefix

    def train_mode(self) -> LiveNet:
        """Frozen stages in eval mode; trainable stages per `bn`; the head has no mode."""
        self.train()
        for name in self.frozen_stages:
            self.staged.stage(name).eval()
        if self.bn == "frozen":
            for name in self.trained_stages:
                for m in self.staged.stage(name).modules():
                    if isinstance(m, nn.modules.batchnorm._BatchNorm):
                        m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.start is not None and self.live_prefix:
            with torch.no_grad():  # frozen prefix: eval mode (train_mode() put it there), no graph
                x = self.staged(x, stop=self.start)
        if self.trainable.mode == "head":
            feats = x if self.start is not None else self.staged(x)
        else:
            feats = self.staged(x, start=self.start)
        return self.head(feats)

    # ------------------------------------------------------------- the travelling state
    def _trained_modules(self) -> list[tuple[str, nn.Module]]:
        return [(f"stage:{n}", self.staged.stage(n)) for n in self.trained_stages] + [("head", self.head)]

    def trained_state(self) -> Params:
        """Parameters and floating buffers of the trainable part, keyed "<stage>/<name>"
        (detached views: clone them to keep a copy)."""
        out: Params = {}
        for prefix, mod in self._trained_modules():
            for k, v in mod.state_dict(keep_vars=True).items():
                if v.is_floating_point():
                    out[f"{prefix}/{k}"] = v.detach()
        return out

    def parameter_keys(self) -> tuple[str, ...]:
        """Keys of `trained_state` that are parameters (the rest are BatchNorm buffers)."""
        keys = []
        for prefix, mod in self._trained_modules():
            keys += [f"{prefix}/{k}" for k, _ in mod.named_parameters()]
        return tuple(keys)

    @torch.no_grad()
    def load_trained_state(self, state: Params) -> None:
        """Copy `state` into the trainable part in place (shapes and keys checked)."""
        own = self.trained_state()
        if set(own) != set(state):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise UserError(f"trained state does not fit the network (missing {missing[:3]}, extra {extra[:3]})")
        for k, t in own.items():
            t.copy_(state[k])

    def trained_params(self) -> list[nn.Parameter]:
        return [p for _, mod in self._trained_modules() for p in mod.parameters()]


def count_values(state: Params, keys: tuple[str, ...] | None = None) -> int:
    return sum(int(v.numel()) for k, v in state.items() if keys is None or k in keys)


def random_head_init(head: nn.Linear, seed: int) -> None:
    """nn.Linear's own initialisation (kaiming-uniform weight, U(+-1/sqrt(fan_in)) bias), drawn
    from `seed`: the paper's FT and Random baselines start from such a head."""
    gen = torch.Generator().manual_seed(int(seed))
    bound = 1.0 / math.sqrt(head.in_features)
    with torch.no_grad():
        head.weight.copy_(torch.empty_like(head.weight, device="cpu").uniform_(-bound, bound, generator=gen))
        head.bias.copy_(torch.empty_like(head.bias, device="cpu").uniform_(-bound, bound, generator=gen))


def reinitialise(module: nn.Module, seed: int) -> None:
    """The Random baseline: every sub-module's own `reset_parameters`, from `seed` (BatchNorm
    statistics reset too), so no pre-trained weight survives."""
    state = torch.random.get_rng_state()
    torch.manual_seed(int(seed))
    try:
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
    finally:
        torch.random.set_rng_state(state)
