"""The LoRA family on the live fine-tuning path (fedheads.finetuning.lora and .adapters): the adapter
maths equals Hugging Face peft's on the same factors; FFA-LoRA's and FLoRA's aggregation is exact
(the new global update equals the clients' mean product), FedIT's gap is what it says; FedSA-LoRA's
B and head are never sent; bytes counted are the sizes of what is sent; cache-first equals live;
resume equals an uninterrupted run; merged and unmerged adapters predict the same; bad input is one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import live_doubles
import pytest
import torch
from torch import nn

from embedcache.errors import UserError
from fedheads.core.protocol import RoundCtx
from fedheads.finetuning.adapters import adapter_algorithms, create_adapter_algorithm
from fedheads.finetuning.adapters.base import AdapterConfig, AdapterFT
from fedheads.finetuning.algorithm import FTConfig
from fedheads.finetuning.lora import LoRALayer
from fedheads.finetuning.model import LiveNet, Trainable
from fedheads.finetuning.runner import FinetuneOptions, finetune_run

ADAPTERS = ("lora", "ffa-lora", "fedsa-lora", "flora")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return root, live_doubles.make_staged_store(root)


def _opts(adapter: str, **kw) -> FinetuneOptions:
    lora = kw.pop("lora", AdapterConfig(rank=2, target_modules="block/0"))
    base = dict(rounds=2, ft=FTConfig(lr=0.1, batch_size=4), num_workers=0, progress=False, device="cpu",
                trainable="after:stem", adapter=adapter, lora=lora, augment=False)
    base.update(kw)
    return FinetuneOptions(**base)


def _final(out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    ck = torch.load(out / "state" / f"seed{seed}.ckpt.pt", weights_only=True)
    return {**ck["params"], **ck["buffers"], **{f"opt{i}": t for i, t in enumerate(ck["opt"])}}


# ---------------------------------------------------------------------------- the adapter maths
class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c3, self.lin = nn.Conv2d(6, 10, 1), nn.Conv2d(10, 8, 3, stride=2, padding=1), nn.Linear(8, 5)

    def forward(self, x):
        return self.lin(self.c3(self.c1(x)).mean((2, 3)))


def test_lora_layers_equal_peft_on_the_same_factors():
    peft = pytest.importorskip("peft")  # a dev dependency: installed wherever the suite runs
    torch.manual_seed(0)
    m, x = _Three(), torch.randn(4, 6, 9, 9)
    cfg = peft.LoraConfig(r=3, lora_alpha=7, target_modules=["c1", "c3", "lin"], lora_dropout=0.0)
    theirs = peft.inject_adapter_in_model(cfg, copy.deepcopy(m))
    ours = copy.deepcopy(m)
    for n in ("c1", "c3", "lin"):
        setattr(ours, n, LoRALayer(getattr(ours, n), 3, 7.0))
    for i, n in enumerate(("c1", "c3", "lin")):
        p, q = getattr(theirs, n), getattr(ours, n)
        torch.manual_seed(10 + i)  # the same draws: our initialisation is peft's (kaiming-uniform A, zero B)
        p.reset_lora_parameters("default", True)
        torch.manual_seed(10 + i)
        q.reset(3)
        torch.testing.assert_close(q.lora_A, p.lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(q.lora_B, p.lora_B["default"].weight, rtol=0, atol=0)
        with torch.no_grad():
            p.lora_B["default"].weight.normal_()
            q.lora_B.copy_(p.lora_B["default"].weight)
        assert q.scaling == pytest.approx(p.scaling["default"])
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    for n in ("c1", "c3", "lin"):
        torch.testing.assert_close(getattr(ours, n).delta_weight(), getattr(theirs, n).get_delta_weight("default"))
    merged = theirs.c3.base_layer.weight + theirs.c3.get_delta_weight("default")
    torch.testing.assert_close(ours.c3.merged().weight, merged)


def test_lora_on_efficientnet_lite0_blocks_equals_peft():
    peft = pytest.importorskip("peft")
    from embedcache.backbones import create_backbone

    stage = create_backbone("efficientnet-lite0", device="cpu").trainable().stage("blocks.6").eval()
    targets = ["0.conv_pw", "0.conv_pwl"]
    torch.manual_seed(3)
    theirs = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets),
                                          copy.deepcopy(stage))
    ours = copy.deepcopy(stage)
    for t in targets:
        parent, attr = ours.get_submodule(t.rpartition(".")[0]), t.rpartition(".")[2]
        setattr(parent, attr, LoRALayer(getattr(parent, attr), 4, 8.0))
        p, q = theirs.get_submodule(t), ours.get_submodule(t)
        with torch.no_grad():
            p.lora_B["default"].weight.normal_(std=0.05)
            q.lora_A.copy_(p.lora_A["default"].weight)
            q.lora_B.copy_(p.lora_B["default"].weight)
    x = torch.randn(2, 192, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- aggregation
def _alg(name: str, M: int = 3, **acfg) -> tuple[AdapterFT, LiveNet]:
    net = LiveNet(live_doubles.build().trainable(), Trainable.parse("after:stem"), 3)
    alg = create_adapter_algorithm(name, FTConfig(), AdapterConfig(**{"rank": 2, "target_modules": "block/0",
                                                                        **acfg}))
    alg.attach(net, "tiny-staged", 0, M)
    return alg, net


def _client_factors(alg: AdapterFT, net: LiveNet, bc, ctx, k: int, gen: torch.Generator):
    """Client k's round without data: its factors moved at random, as training would."""
    alg.prepare(net, bc, ctx, k)
    with torch.no_grad():
        for layer in alg.layers.values():
            if "A" in alg.trains:
                layer.lora_A.add_(0.3 * torch.randn(layer.lora_A.shape, generator=gen))
            if "B" in alg.trains:
                layer.lora_B.add_(0.3 * torch.randn(layer.lora_B.shape, generator=gen))
        net.head.weight.add_(0.1)
    return alg.message(bc, net, 10 * (k + 1)), {n: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone(),
                                                    layer.scaling) for n, layer in alg.layers.items()}


@pytest.mark.parametrize("name", ["ffa-lora", "flora"])
def test_ffa_and_flora_aggregation_is_the_mean_of_the_clients_products(name):
    alg, net = _alg(name, ranks="1,2,3" if name == "flora" else "")
    ss = alg.init(alg.start_model(net))
    ctx = RoundCtx(round=0, seed=0, participants=torch.tensor([0, 1, 2]), num_clients=3)
    gen = torch.Generator().manual_seed(0)
    sums, products, n = alg.sums_init(ss, ctx), {}, {}
    for k in range(3):
        msg, f = _client_factors(alg, net, alg.client_start(ss, k), ctx, k, gen)
        sums = alg.sums_add(sums, msg)
        n[k] = 10 * (k + 1)
        for name_, (A, B, s) in f.items():
            products.setdefault(name_, []).append(alg.layers[name_].delta_weight(A.double(), B.double(), scale=s))
    new, _ = alg.server_finalize(ss, sums, ctx)
    N = sum(n.values())
    for name_, layer in alg.layers.items():
        want = sum(n[k] * products[name_][k] for k in range(3)) / N  # sum_k p_k s B_k A_k
        if name == "flora":  # merged into the weights: W1 - W0
            got = new.model.buffers[f"base:{name_}"].double() - ss.model.buffers[f"base:{name_}"].double()
            assert int(new.stats["stack_values"]) == sum(r * (layer.in_dim * 9 + layer.out_dim) for r in (1, 2, 3))
        else:  # the global adapter's product (it started at B = 0)
            A, B = new.model.buffers[alg.key(name_, "A")], new.model.params[alg.key(name_, "B")]
            got = layer.delta_weight(A.double(), B.double())
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)


def test_fedit_averages_factors_separately_and_measures_the_gap():
    alg, net = _alg("lora")
    ss = alg.init(alg.start_model(net))
    ctx = RoundCtx(round=0, seed=0, participants=torch.tensor([0, 1, 2]), num_clients=3)
    gen = torch.Generator().manual_seed(1)
    sums, facts, ws = alg.sums_init(ss, ctx), [], []
    for k in range(3):
        msg, f = _client_factors(alg, net, alg.client_start(ss, k), ctx, k, gen)
        sums = alg.sums_add(sums, msg)
        facts.append(f)
        ws.append(10.0 * (k + 1))
    new, _ = alg.server_finalize(ss, sums, ctx)
    N = sum(ws)
    (name, layer), = alg.layers.items()
    Abar = sum(w * f[name][0].double() for w, f in zip(ws, facts)) / N
    Bbar = sum(w * f[name][1].double() for w, f in zip(ws, facts)) / N
    torch.testing.assert_close(new.model.params[alg.key(name, "A")].double(), Abar)
    torch.testing.assert_close(new.model.params[alg.key(name, "B")].double(), Bbar)
    ideal = sum(w * layer.delta_weight(f[name][0].double(), f[name][1].double()) for w, f in zip(ws, facts)) / N
    before = layer.delta_weight(ss.model.params[alg.key(name, "A")].double(), ss.model.params[alg.key(name, "B")].double())
    gap = float((ideal - layer.delta_weight(Abar, Bbar)).norm() / (ideal - before).norm())
    assert gap > 1e-3  # the product of averages is not the average of products
    assert float(new.stats["aggregation_gap"]) == pytest.approx(gap, rel=1e-6)


def test_fedsa_lora_never_sends_b_or_the_head_and_clients_keep_their_own():
    alg, net = _alg("fedsa-lora")
    ss = alg.init(alg.start_model(net))
    assert set(ss.model.params) == {alg.key(n, "A") for n in alg.layers}  # the broadcast: A only
    ctx = RoundCtx(round=0, seed=0, participants=torch.tensor([0, 2]), num_clients=3)
    gen = torch.Generator().manual_seed(2)
    for k in (0, 2):
        msg, f = _client_factors(alg, net, alg.client_start(ss, k), ctx, k, gen)
        assert all(key.startswith("lora_A:") for key in msg.delta) and not msg.buffer_delta
        ss = alg.client_keep(ss, k, net)
        (name, (A, B, _)), = f.items()
        torch.testing.assert_close(ss.local[alg.key(name, "B")][k], B)
    assert float(ss.local[alg.key(name, "B")][1].abs().sum()) == 0  # client 1 did not train: B = 0
    heads = ss.local["head/weight"]
    assert not torch.equal(heads[0], heads[1]) and torch.equal(heads[1], alg.start_model(net).params.get(
        "head/weight", heads[1]))


# ---------------------------------------------------------------------------- whole runs
def test_every_adapter_is_registered():
    assert tuple(sorted(adapter_algorithms())) == tuple(sorted(ADAPTERS))


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_cache_first_equals_live_and_bytes_are_the_messages(setup, tmp_path, adapter):
    root, _ = setup
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    lora = AdapterConfig(rank=2, target_modules="block/0", ranks="1,3" if adapter == "flora" else "")
    a = finetune_run(*args, tmp_path / "cache", _opts(adapter, lora=lora))
    finetune_run(*args, tmp_path / "live", _opts(adapter, lora=lora, live_prefix=True))
    fa, fb = _final(tmp_path / "cache"), _final(tmp_path / "live")
    assert set(fa) == set(fb)
    for k in fa:
        torch.testing.assert_close(fa[k], fb[k], rtol=1e-5, atol=1e-6)
    # what is sent per client and round, from the layer sizes (the message's weight n_k is one float64)
    C, D = 3, 8
    A_n, B_n = 4 * 9, 8  # per unit of rank: block/0 is a 3x3 conv 4 -> 8
    head = C * D + C
    up = {"lora": 2 * (A_n + B_n) + head, "ffa-lora": 2 * B_n + head, "fedsa-lora": 2 * A_n}
    rounds = json.loads((tmp_path / "cache" / "results.json").read_text())
    ck = torch.load(tmp_path / "cache" / "state" / "seed0.ckpt.pt", weights_only=True)
    for rec in ck["history"][1:]:
        parts = rec["participants"]
        if adapter == "flora":
            want = sum((1, 3)[i % 2] * (A_n + B_n) + head for i in parts)
        else:
            want = len(parts) * up[adapter]
        assert rec["up_values"] == want + len(parts)
        assert rec["up_bytes"] == 4 * want + 8 * len(parts)
    assert rounds["adapters"]["algorithm"] == adapter
    assert a["algorithm"] == f"fedncm+{adapter}"


@pytest.mark.parametrize("adapter", ["fedsa-lora", "flora"])
def test_resume_equals_an_uninterrupted_run(setup, tmp_path, adapter):
    root, _ = setup
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    finetune_run(*args, tmp_path / "straight", _opts(adapter, rounds=3))
    finetune_run(*args, tmp_path / "split", _opts(adapter, rounds=1))
    finetune_run(*args, tmp_path / "split", _opts(adapter, rounds=3, resume=True))
    assert live_doubles.digest(_final(tmp_path / "straight")) == live_doubles.digest(_final(tmp_path / "split"))
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("straight", "split"))
    assert a["history"] == b["history"]


def test_merged_adapters_predict_as_the_adapted_network(setup, tmp_path):
    root, _ = setup
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "r", _opts("lora", rounds=2))
    alg, net = _alg("lora")
    ck = torch.load(tmp_path / "r" / "state" / "seed0.ckpt.pt", weights_only=True)
    from fedheads.algorithms.pfl_common import GlobalModel

    alg.load(net, GlobalModel(ck["params"], ck["buffers"]))
    net.eval()
    x = torch.randn(5, 4, 8, 8)
    with torch.no_grad():
        adapted = net(x)
        alg.merge_into(net)
        assert not any(isinstance(m, LoRALayer) for m in net.modules())
        torch.testing.assert_close(net(x), adapted, rtol=1e-5, atol=1e-6)
    # the exported backbone (a `ckpt:` file, what `embedcache extract` and `fedheads predict` read) is the merged one
    from embedcache.backbones import create_backbone

    exported = create_backbone(f"ckpt:{tmp_path / 'r' / 'state' / 'seed0.backbone.pt'}", device="cpu").trainable()
    torch.testing.assert_close(exported.stage("block")[0].weight, net.staged.stage("block")[0].weight)
    assert not torch.equal(exported.stage("block")[0].weight, live_doubles.build().trainable().stage("block")[0].weight)


# ---------------------------------------------------------------------------- bad input
def test_bad_adapter_input_is_one_line(setup, tmp_path):
    root, _ = setup
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    cases = [
        (dict(lora=AdapterConfig(rank=9, target_modules="block/0")), r"rank 9: must be between 1 and 4.*block/0"),
        (dict(lora=AdapterConfig(target_modules="block/nothing")), r"target_modules 'block/nothing': matches no layer"),
        (dict(lora=AdapterConfig()), r"adapters on tiny-staged: no default target modules"),
        (dict(lora=AdapterConfig(target_modules="block/1")), r"target block/1 \(BatchNorm2d\)"),
        (dict(trainable="head"), r"adapters need stages to adapt"),
        (dict(pretrained=False, trainable="all", heads=("random",)), r"adapters adapt pre-trained weights"),
    ]
    for i, (kw, match) in enumerate(cases):
        with pytest.raises(UserError, match=match):
            finetune_run(*args, tmp_path / f"x{i}", _opts("lora", **kw))
        assert not (tmp_path / f"x{i}" / "results.json").exists()
    with pytest.raises(UserError, match="rank 0: must be at least 1"):
        AdapterConfig(rank=0)
    with pytest.raises(UserError, match="adapter 'dora': use none or one of fedsa-lora, ffa-lora, flora, lora"):
        _opts("dora")
    with pytest.raises(UserError, match="ranks '4,x'"):
        AdapterConfig(ranks="4,x")
    with pytest.raises(UserError, match=r"ranks '2,9': rank 9 exceeds the width of block/0"):
        finetune_run(*args, tmp_path / "y", _opts("flora", lora=AdapterConfig(rank=2, target_modules="block/0",
                                                                              ranks="2,9")))


# ---------------------------------------------------------------------------- client-level DP
def test_dp_clips_each_client_and_adds_the_stated_noise():
    from fedheads.privacy_accounting import epsilon

    alg, net = _alg("ffa-lora", dp_epsilon=2.0, dp_clip=0.05)
    block = alg.privatise(rounds=5)
    z = alg.noise_multiplier
    assert block["epsilon"] == pytest.approx(epsilon(z, 1e-5, 5)) and block["epsilon"] <= 2.0
    assert block["noise_std"] == pytest.approx(z * 0.05)
    ss = alg.init(alg.start_model(net))
    ctx = RoundCtx(round=0, seed=0, participants=torch.tensor([0, 1, 2]), num_clients=3)
    gen = torch.Generator().manual_seed(0)
    sums, clipped = alg.sums_init(ss, ctx), []
    for k in range(3):
        msg, _ = _client_factors(alg, net, alg.client_start(ss, k), ctx, k, gen)
        norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in msg.delta.values())))
        clipped.append({key: v[0].double() * min(1.0, 0.05 / norm) for key, v in msg.delta.items()})
        sums = alg.sums_add(sums, msg)
    assert float(sums.weight) == 3  # weight 1 per client, not n_k
    for key in sums.delta:  # the sum of the clipped updates, before the noise
        torch.testing.assert_close(sums.delta[key].double(), sum(c[key] for c in clipped), rtol=1e-5, atol=1e-7)
    new, _ = alg.server_finalize(ss, sums, ctx)
    assert float(new.stats["dp_clipped_fraction"]) == 1.0
    # the noise: (new - old) * m - sum of clipped = z C times the standard normal draw of (seed, round, tensor)
    from fedheads.privacy import gaussian

    for i, k in enumerate(sorted(sums.delta)):
        noise = (new.model.params[k].double() - ss.model.params[k].double()) * 3 - sum(c[k] for c in clipped)
        want = z * 0.05 * gaussian(noise.shape, (0, 0, i, 0xD9A), "cpu")
        torch.testing.assert_close(noise, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(UserError, match="flora sends new factors every round"):
        _alg("flora", dp_epsilon=1.0)[0].privatise(rounds=3)


def test_dp_noise_variance_over_many_draws():
    """The draws the mechanism scales by z C are standard normal: variance (z C)^2 per entry."""
    from fedheads.privacy import gaussian

    alg, _ = _alg("lora", dp_epsilon=1.0, dp_clip=0.2)
    alg.privatise(rounds=10)
    draws = torch.cat([alg.noise_multiplier * 0.2 * gaussian((1000,), (0, r, 0, 0xD9A), "cpu") for r in range(50)])
    assert float(draws.var()) == pytest.approx((alg.noise_multiplier * 0.2) ** 2, rel=0.03)


def test_cli_adapter_errors_are_one_line(setup, tmp_path):
    import subprocess
    import sys

    import kill_helpers

    root, _ = setup
    base = [sys.executable, "-m", "fedheads.cli", "finetune", "--manifest", str(root / "manifest.json"), "--store",
            str(root / "s.zarr"), "--backbone", "efficientnet-lite0", "--out", str(tmp_path / "x")]
    for extra, needle in ((["--set", "adapter=dora"], "adapter 'dora'"), (["--set", "rank=0"], "rank 0"),
                          (["--set", "ranks=4,x"], "ranks '4,x'")):
        p = subprocess.run(base + extra, capture_output=True, text=True, env=kill_helpers.subprocess_env(), timeout=300)
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and needle in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


def test_kill_minus_9_then_resume_is_identical(setup, tmp_path):
    """FedSA-LoRA: the clients' own B and heads are in the checkpoint too."""
    root, _ = setup
    ref, killed = live_doubles.kill_after_round_2_then_resume(
        root, tmp_path, 'rounds=4, ft=FTConfig(lr=0.1, batch_size=4), trainable="after:stem", adapter="fedsa-lora", '
        'augment=False, lora=AdapterConfig(rank=2, target_modules="block/0")')
    assert live_doubles.digest(_final(ref)) == live_doubles.digest(_final(killed))


@pytest.mark.parametrize("adapter,lr", [("lora", 0.5), ("none", 0.2), ("flora", 0.5)])
def test_predict_serves_a_finetuned_run_as_it_evaluated(setup, tmp_path, adapter, lr):
    """`fedheads predict` on a fine-tuning run: the exported backbone (adapters merged) and the final
    head classify each client's test split as the run's own last evaluation did (the adapted,
    unmerged network on cached maps)."""
    import numpy as np

    import fedheads

    root, m = setup
    kw = {} if adapter != "none" else {"lora": AdapterConfig()}
    res = finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "r",
                       _opts(adapter, rounds=4, ft=FTConfig(lr=lr, batch_size=4), **kw))
    table = fedheads.predict(tmp_path / "r", manifest=root / "manifest.json", split="test", cache=str(tmp_path / "c"))
    if adapter != "flora":  # (FLoRA's head says one class on these 27 images at every lr tried)
        assert len(set(table["prediction"].tolist())) > 1  # a head that says one class everywhere proves little
    for client in m.clients:
        ids = {s.id for s in client.test}
        rows = np.array([i in ids for i in table["sample_id"]])
        assert rows.sum() == len(ids)
        acc = 100.0 * float(np.mean(table["prediction"][rows] == table["label"][rows]))
        assert acc == pytest.approx(res["per_client"][client.name]["mean"], abs=1e-6), client.name


def test_predict_refuses_a_personalised_run(setup, tmp_path):
    import fedheads

    root, _ = setup
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "r", _opts("fedsa-lora", rounds=1))
    with pytest.raises(UserError, match="keeps a model per client"):
        fedheads.predict(tmp_path / "r", manifest=root / "manifest.json", split="test")


# ---------------------------------------------------------------------------- default targets per family
def test_default_targets_of_each_family():
    """EfficientNet-Lite: the pointwise convolutions and conv_head after the cut; a timm ViT: qkv and
    proj of its blocks; MiniLM (when installed): the attention's query, key, value and output."""
    import timm

    from embedcache.backbones import create_backbone
    from fedheads.finetuning.lora import default_targets, find_targets

    lite = create_backbone("efficientnet-lite0", device="cpu").trainable()
    names = [n for n, _, _ in find_targets(lite, ("blocks.6", "features"), default_targets("efficientnet-lite0").patterns)]
    assert names == ["blocks.6/0.conv_pw", "blocks.6/0.conv_pwl", "features/0"]

    class Staged:  # the two stages find_targets reads, over a randomly initialised timm ViT
        def __init__(self) -> None:
            self.vit = timm.create_model("vit_tiny_patch16_224", pretrained=False)

        def stage(self, name: str) -> nn.Module:
            return self.vit.blocks[int(name.split(".")[1])]

    fam = default_targets("timm:vit_tiny_patch16_224")
    assert [n for n, _, _ in find_targets(Staged(), ("blocks.11",), fam.patterns)] == ["blocks.11/attn.qkv",
                                                                                       "blocks.11/attn.proj"]
    from embedcache.backbones.registry import list_backbones

    row = {r.name: r for r in list_backbones()}.get("minilm-l6-v2")
    if row is None or not row.available:
        return  # the [vl] extra is not installed here: the other families are checked
    text = create_backbone("minilm-l6-v2", device="cpu").trainable()
    got = [n for n, _, _ in find_targets(text, ("layer.5",), default_targets("minilm-l6-v2").patterns)]
    assert got == ["layer.5/attention.self.query", "layer.5/attention.self.key", "layer.5/attention.self.value",
                   "layer.5/attention.output.dense"]
