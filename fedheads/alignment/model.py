"""FedDRA's network: two encoders with an alignment module on each, one model on the device.

FedDRA (TMLR submission) Sec. 4.2: the image encoder f_psi and the text encoder f_phi give
intermediate features z~x, z~y; the alignment modules f_Psi, f_Phi ("an extra transformer block",
Sec. 5.1.3) map them to the aligned zx, zy. theta = (psi, phi), Theta = (Psi, Phi).

Alignment module (FedDRA notes, "Stage 1, cached"): Linear(D_in, d) -> one pre-norm transformer
block over the tokens (d = 128, 4 heads, MLP 4d, key-padding mask) -> masked mean -> Linear(d,
d_out = 128); the L2 normalisation happens in the loss (feddra.py), so L_C can also be taken on
the raw output. The block is written out with scaled_dot_product_attention (no dropout): its
numbers do not depend on train/eval mode, so the cached and the live stage 1 agree.

What trains: stage 1 (Alg. 2) the alignment modules only; stage 2 (Alg. 3) the encoders too,
`image_trainable` / `text_trainable` = "all" (the paper), "after:STAGE" (a labelled CPU
deviation: the stages after STAGE; the image encoder's stages after the token cut are never
used) or "frozen". The travelling state is keyed "psi/...", "phi/...", "image:<stage>/...",
"text:<stage>/..." (floating BatchNorm buffers included, as in fedheads.finetuning.model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embedcache.errors import UserError
from fedheads.alignment import vl

Params = dict[str, torch.Tensor]
MODULE_PREFIXES = ("psi/", "phi/")


class TokenBlock(nn.Module):
    """One pre-norm transformer block: x + MHA(LN(x)), then x + MLP(LN(x)) (GELU)."""

    def __init__(self, d: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        if d % heads:
            raise UserError(f"alignment width {d} is not divisible by {heads} heads")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no key bias: it shifts every logit of a query by the same amount, so its gradient is
        # exactly zero and Adam would turn float noise in it into lr-sized, irreproducible steps
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, mlp_ratio * d), nn.Linear(mlp_ratio * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, d = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(B, T, self.heads, d // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        attn = None if mask is None else mask[:, None, None, :]  # keys: True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class AlignmentModule(nn.Module):
    """f_Psi / f_Phi: tokens [B, T, D_in] (+ mask [B, T]) -> [B, d_out] (not yet normalised)."""

    def __init__(self, d_in: int, d: int = 128, heads: int = 4, mlp_ratio: int = 4, d_out: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.block = TokenBlock(d, heads, mlp_ratio)
        self.out = nn.Linear(d, d_out)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.block(self.inp(tokens), mask)
        if mask is None:
            pooled = h.mean(1)
        else:
            w = mask.to(h.dtype).unsqueeze(-1)
            pooled = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        return self.out(pooled)


@dataclass(frozen=True)
class ModuleShape:
    """Alignment module hyper-parameters (FedDRA notes: d = 128, 4 heads, MLP 4d, d_out = 128)."""

    width: int = 128
    heads: int = 4
    mlp_ratio: int = 4
    out_dim: int = 128


def _trained_stages(names: tuple[str, ...], spec: str, last: str | None, who: str) -> tuple[str, ...]:
    """Stages that train in stage 2 for `spec` ("all" | "after:STAGE" | "frozen"), up to `last`."""
    usable = names[: names.index(last) + 1] if last is not None and names else names
    if spec == "all":
        return usable
    if spec == "frozen":
        return ()
    kind, _, cut = spec.partition(":")
    if kind == "after" and cut in usable:
        return usable[usable.index(cut) + 1:]
    raise UserError(f"{who}_trainable {spec!r}: use all, frozen or after:STAGE with STAGE one of "
                    f"{', '.join(usable)}")


class DualEncoder(nn.Module):
    """Image encoder (a StagedNet, tokens after `image_cut`) + text encoder + f_Psi + f_Phi."""

    def __init__(self, image: nn.Module, image_cut: str, text: nn.Module, text_dim: int, *,
                 shape: ModuleShape = ModuleShape(), image_trainable: str = "all", text_trainable: str = "all",
                 bn: str = "frozen", seed: int = 0, text_cut: str | None = None) -> None:
        super().__init__()
        if image_cut not in image.cut_points():
            raise UserError(f"--image-cut {image_cut}: {image.name} has no cut {image_cut!r} "
                            f"(cut points: {', '.join(image.cut_points()) or 'none'})")
        if bn not in ("train", "frozen"):
            raise UserError(f"bn {bn!r}: use train or frozen")
        self.image, self.text, self.image_cut, self.bn = image, text, image_cut, bn
        names = vl.stage_names(text)
        if text_cut is None and names:
            text_cut = text.cut_points()[-1]  # the last layer: what the pooled embedding averages
        if names and text_cut not in text.cut_points():
            raise UserError(f"--text-cut {text_cut}: {getattr(text, 'name', 'the text encoder')} has no cut "
                            f"{text_cut!r} ({', '.join(text.cut_points())})")
        self.text_cut = text_cut
        T, d_img = vl.image_token_shape(image, image_cut)
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(int(seed))  # the modules' initialisation is a function of the run seed
        try:
            self.psi = AlignmentModule(d_img, shape.width, shape.heads, shape.mlp_ratio, shape.out_dim)
            self.phi = AlignmentModule(int(text_dim), shape.width, shape.heads, shape.mlp_ratio, shape.out_dim)
        finally:
            torch.random.set_rng_state(gen_state)
        self.image_stages = _trained_stages(tuple(image.stage_names), image_trainable, image_cut, "image")
        self.text_stages = _trained_stages(names, text_trainable, text_cut, "text")
        self.image.requires_grad_(False)
        self.text.requires_grad_(False)
        for n in self.image_stages:
            image.stage(n).requires_grad_(True)
        for n in self.text_stages:
            vl.stage_module(text, n).requires_grad_(True)
        self.eval()

    # ------------------------------------------------------------- forward passes
    def image_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return vl.map_tokens(self.image(x, stop=self.image_cut))

    def text_tokens(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return vl.text_states(self.text, ids, mask, self.text_cut)

    def align(self, img: torch.Tensor, img_mask: torch.Tensor | None, txt: torch.Tensor,
              txt_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(zx, zy) before normalisation, from token states."""
        return self.psi(img, img_mask), self.phi(txt, txt_mask)

    def set_mode(self, stage: int) -> DualEncoder:
        """Stage 1: modules train, encoders eval (frozen). Stage 2: the trained encoder stages
        train too (BatchNorm per `bn`); frozen stages stay in eval mode."""
        self.eval()
        self.psi.train()
        self.phi.train()
        if stage == 2:
            for n in self.image_stages:
                m = self.image.stage(n).train()
                if self.bn == "frozen":
                    for b in m.modules():
                        if isinstance(b, nn.modules.batchnorm._BatchNorm):
                            b.eval()
            for n in self.text_stages:
                vl.stage_module(self.text, n).train()
        return self

    # ------------------------------------------------------------- the travelling state
    def _parts(self, stage: int) -> list[tuple[str, nn.Module]]:
        parts = [("psi", self.psi), ("phi", self.phi)]
        if stage == 2:
            parts += [(f"image:{n}", self.image.stage(n)) for n in self.image_stages]
            parts += [(f"text:{n}", vl.stage_module(self.text, n)) for n in self.text_stages]
        return parts

    def state(self, stage: int = 2) -> Params:
        """Parameters and floating buffers of what trains in `stage` (stage 2: everything
        trained; detached views)."""
        out: Params = {}
        for prefix, mod in self._parts(stage):
            for k, v in mod.state_dict(keep_vars=True).items():
                if v.is_floating_point():
                    out[f"{prefix}/{k}"] = v.detach()
        return out

    def parameter_keys(self, stage: int = 2) -> tuple[str, ...]:
        return tuple(f"{p}/{k}" for p, mod in self._parts(stage) for k, _ in mod.named_parameters())

    def named_trained(self, stage: int) -> list[tuple[str, nn.Parameter]]:
        return [(f"{p}/{k}", v) for p, mod in self._parts(stage) for k, v in mod.named_parameters()]

    @torch.no_grad()
    def load_state(self, state: Params) -> None:
        """Copy a (sub-)state in place; every key must belong to this network's stage-2 state."""
        own = self.state(2)
        extra = sorted(set(state) - set(own))
        if extra:
            raise UserError(f"FedDRA state does not fit the network (unknown keys {extra[:3]})")
        for k, v in state.items():
            own[k].copy_(v)

    @property
    def trains_encoders(self) -> bool:
        return bool(self.image_stages or self.text_stages)


def is_module_key(key: str) -> bool:
    return key.startswith(MODULE_PREFIXES)
