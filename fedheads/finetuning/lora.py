"""Low-rank adapters (LoRA) on the trainable stages of a live network.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, Sec. 4.1: a frozen
weight W0 of a layer is adapted as W0 + (alpha / r) B A, with A in R^{r x k} and B in R^{d x r},
A drawn at random and B = 0 (so the adapted network starts as the pre-trained one), and
h = W0 x + (alpha / r) B A x (Eq. 3). The layout, initialisation and merge are Hugging Face
`peft`'s LoRA layers (`peft.tuners.lora.layer`: A kaiming-uniform(a = sqrt 5), B zeros, dropout on
the input of A; for a convolution A has the base layer's kernel, stride, padding and dilation and
B is 1x1), so a model adapted here equals the same model adapted by `peft` (a test checks forward
outputs and merged weights on the same factors).

Adapters go only on the modules after the cut (`trainable=after:CUT`), so the frozen prefix's
maps keep coming from the feature store (cache-first); with `trainable=all` it is plain live LoRA.

Targets: `target_modules` (comma-separated fnmatch patterns over "<stage>/<path in stage>", e.g.
"blocks.6/*conv_pw*"), or the family default (DEFAULT_TARGETS, each stated with its source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from embedcache.errors import UserError


@dataclass(frozen=True)
class TargetFamily:
    label: str
    prefixes: tuple[str, ...]  # backbone names (or their ckpt: base) starting with one of these
    patterns: tuple[str, ...]  # fnmatch over "<stage>/<path>"
    source: str


DEFAULT_TARGETS = (
    TargetFamily("EfficientNet-Lite", ("efficientnet-lite",), ("*.conv_pw", "*.conv_pwl", "features/0"),
                 "the pointwise 1x1 convolutions of the MBConv blocks and conv_head (features/0): the blocks' "
                 "dense weights (the depthwise 3x3/5x5 convolutions are grouped and hold few parameters); "
                 "LoRA's own choice is the dense projections (Hu et al. 2022, Sec. 4.2)"),
    TargetFamily("BERT / MiniLM", ("minilm", "bert"), ("*attention.self.query", "*attention.self.key",
                                                         "*attention.self.value", "*attention.output.dense"),
                 "the attention projections W_q, W_k, W_v, W_o (Hu et al. 2022, Sec. 4.2 and 7.1)"),
    TargetFamily("timm ViT", ("timm:vit", "timm:deit", "timm:eva"), ("*attn.qkv", "*attn.proj"),
                 "the attention projections (fused qkv and the output proj: Hu et al. 2022, Sec. 4.2)"),
)


def default_targets(backbone: str) -> TargetFamily | None:
    return next((f for f in DEFAULT_TARGETS if backbone.startswith(f.prefixes)), None)


class LoRALayer(nn.Module):
    """A frozen nn.Linear or ungrouped nn.Conv2d plus (alpha / r) B A (module docstring)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if isinstance(base, nn.Linear):
            self.kind, self.in_dim, self.out_dim = "linear", base.in_features, base.out_features
        elif isinstance(base, nn.Conv2d) and type(base) is nn.Conv2d and base.groups == 1:
            self.kind, self.in_dim, self.out_dim = "conv", base.in_channels, base.out_channels
        else:
            raise UserError(f"{type(base).__name__}: LoRA adapts nn.Linear and ungrouped nn.Conv2d layers only")
        self.base = base
        self.alpha, self.dropout_p = float(alpha), float(dropout)
        self.lora_A = nn.Parameter(torch.empty(0))
        self.lora_B = nn.Parameter(torch.empty(0))
        self.reset(rank)

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # Hu et al. 2022 Sec. 4.1: alpha / r

    def check_rank(self, rank: int, name: str = "") -> None:
        if not 1 <= rank <= min(self.in_dim, self.out_dim):
            raise UserError(f"rank {rank}: must be between 1 and {min(self.in_dim, self.out_dim)} "
                            f"(the width of {name or 'the layer'}, {self.in_dim} -> {self.out_dim})")

    def reset(self, rank: int, generator: torch.Generator | None = None, alpha: float | None = None) -> None:
        """Fresh factors of rank `rank`: A kaiming-uniform(a=sqrt 5) (peft's default), B = 0;
        `alpha` replaces the layer's alpha (FLoRA keeps alpha / r fixed across ranks)."""
        self.check_rank(rank)
        if alpha is not None:
            self.alpha = float(alpha)
        w = self.base.weight
        a_shape = (rank, self.in_dim, *w.shape[2:]) if self.kind == "conv" else (rank, self.in_dim)
        b_shape = (self.out_dim, rank, 1, 1) if self.kind == "conv" else (self.out_dim, rank)
        a = torch.empty(a_shape, dtype=w.dtype)
        fan_in = math.prod(a_shape[1:])
        bound = 1.0 / math.sqrt(fan_in)  # = kaiming_uniform_(a=sqrt(5)): gain sqrt(2/6), bound gain*sqrt(3/fan_in)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(w.device))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=w.dtype, device=w.device))

    def delta_weight(self, A: torch.Tensor | None = None, B: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
        """scale B A in the base weight's layout (peft's get_delta_weight); scale defaults to
        alpha / r of the factors given (r = A's rows)."""
        A = self.lora_A if A is None else A
        B = self.lora_B if B is None else B
        s = self.alpha / A.shape[0] if scale is None else scale
        if self.kind == "linear":
            return (B @ A) * s
        if A.shape[2:] == (1, 1):
            return (B.flatten(1) @ A.flatten(1)).view(self.out_dim, self.in_dim, 1, 1) * s
        return F.conv2d(A.transpose(0, 1), B).transpose(0, 1) * s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        h = F.dropout(x, self.dropout_p, self.training) if self.dropout_p else x
        if self.kind == "linear":
            return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling
        b = self.base
        return out + F.conv2d(F.conv2d(h, self.lora_A, None, b.stride, b.padding, b.dilation), self.lora_B) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """The base layer with (alpha / r) B A added to its weight (a copy; self is unchanged)."""
        import copy

        out = copy.deepcopy(self.base)
        out.weight.add_(self.delta_weight())
        return out


def find_targets(staged: nn.Module, stages: tuple[str, ...], patterns: tuple[str, ...]) -> list[tuple[str, nn.Module,
                                                                                                       str]]:
    """[(qualified name "<stage>/<path>", parent module, attribute)] of the layers of `stages`
    that one of `patterns` matches (fnmatch)."""
    out = []
    for stage in stages:
        for path, _ in staged.stage(stage).named_modules():
            if not path:
                continue
            name = f"{stage}/{path}"
            if any(fnmatchcase(name, p) for p in patterns):
                parent_path, _, attr = path.rpartition(".")
                parent = staged.stage(stage).get_submodule(parent_path) if parent_path else staged.stage(stage)
                out.append((name, parent, attr))
    return out


def attach_adapters(staged: nn.Module, stages: tuple[str, ...], backbone: str, *, rank: int, alpha: float,
                    dropout: float = 0.0, target_modules: str = "",
                    generator: torch.Generator | None = None) -> dict[str, LoRALayer]:
    """Freeze every weight of `staged`, wrap the target layers of `stages` in LoRALayers (in place)
    and return them by qualified name. UserError (one line) for a pattern matching nothing, a
    family with no default and no `target_modules`, or a rank outside [1, layer width]."""
    given = bool(target_modules.strip())
    if given:
        patterns = tuple(p.strip() for p in target_modules.split(",") if p.strip())
    else:
        fam = default_targets(backbone)
        if fam is None:
            raise UserError(f"adapters on {backbone}: no default target modules for this backbone family "
                            "(defaults: " + "; ".join(f"{f.label}" for f in DEFAULT_TARGETS) +
                            "); name them with --set target_modules=PATTERN,... (fnmatch over <stage>/<path>)")
        patterns = fam.patterns
    if not stages:
        raise UserError("adapters: no stage after the cut (trainable=head leaves nothing to adapt)")
    staged.requires_grad_(False)
    found = find_targets(staged, stages, patterns)
    # a pattern the user names must match; a family's defaults must match something after the cut
    for p in patterns if given else ():
        if not any(fnmatchcase(n, p) for n, _, _ in found):
            raise UserError(f"target_modules {p!r}: matches no layer of the stages after the cut "
                            f"({', '.join(stages)}) of {backbone}")
    if not found:
        raise UserError(f"adapters on {backbone}: the default targets ({', '.join(patterns)}) match no layer after "
                        f"the cut ({', '.join(stages)}); cut earlier or name --set target_modules")
    layers: dict[str, LoRALayer] = {}
    for name, parent, attr in found:
        base = getattr(parent, attr)
        if isinstance(base, LoRALayer):
            continue
        if not (isinstance(base, nn.Linear) or (type(base) is nn.Conv2d and base.groups == 1)):
            raise UserError(f"target {name} ({type(base).__name__}): LoRA adapts nn.Linear and ungrouped "
                            "nn.Conv2d layers; narrow target_modules")
        d_in, d_out = (base.in_features, base.out_features) if isinstance(base, nn.Linear) else \
            (base.in_channels, base.out_channels)
        if not 1 <= rank <= min(d_in, d_out):
            raise UserError(f"rank {rank}: must be between 1 and {min(d_in, d_out)} (the width of {name}, "
                            f"{d_in} -> {d_out})")
        layer = LoRALayer(base, rank, alpha, dropout)
        if generator is not None:
            layer.reset(rank, generator)
        setattr(parent, attr, layer)
        layers[name] = layer
    return layers
