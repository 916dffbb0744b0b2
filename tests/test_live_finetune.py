"""Live fine-tuning (fedheads.finetuning): FedNCM+FT's round 0 equals FedNCM on the store, cache-first
partial fine-tuning equals the live frozen-prefix run, sums + finalize equal the stacked server
step, resume after a kill ends identical, and bad input gives one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kill_helpers
import live_doubles  # noqa: F401  (registers tiny-staged)
import pytest
import torch
from store_doubles import make_manifest

from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import save_manifest
from fedheads.finetuning.algorithm import FineTune, FTConfig
from fedheads.finetuning.runner import FinetuneOptions, finetune_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    return root, live_doubles.make_staged_store(root)


def _opts(**kw) -> FinetuneOptions:
    base = dict(rounds=2, ft=FTConfig(lr=0.05, batch_size=4), num_workers=0, progress=False, device="cpu")
    base.update(kw)
    return FinetuneOptions(**base)


def _final_state(out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    ck = torch.load(out / "state" / f"seed{seed}.ckpt.pt", weights_only=True)
    return {**ck["params"], **ck["buffers"]}


def test_fedncm_ft_round0_equals_fedncm_on_the_store(setup, tmp_path):
    from fedheads.run.train import TrainOptions, train_run

    root, m = setup
    res = finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "ft", _opts())
    ncm = train_run(str(root / "s.zarr"), ["tiny-staged"], "fedncm",
                    TrainOptions(rounds=1, seeds=(0,), progress=False, device="cpu"), tmp_path / "ncm")
    ck = torch.load(tmp_path / "ft" / "state" / "seed0.ckpt.pt", weights_only=True)
    live0 = dict(zip([c.name for c in m.clients], (100 * a for a in ck["history"][0]["accuracy"])))
    assert ck["history"][0]["round"] == 0
    assert live0 == pytest.approx({c: v["mean"] for c, v in ncm["per_client"].items()}, abs=1e-9)
    assert res["algorithm"] == "fedncm+ft"
    assert res["stages"][0]["method"] == "fedncm" and res["figure1"][0]["round"] == 0
    assert (tmp_path / "ft" / "figure1.png").is_file() and (tmp_path / "ft" / "results.json").is_file()
    # results.json's per_client carries each client's test size, as `fedheads train`'s (contract 6)
    assert {c: v["n_test"] for c, v in res["per_client"].items()} == \
        {c: v["n_test"] for c, v in ncm["per_client"].items()} and all(v["n_test"] > 0 for v in ncm["per_client"].values())
    # FedNCM App. A for this run's own sizes, counted here from the network, not through fedheads.report.communication:
    # Eq. 4: 2 (LL_out LL_in + P) K R x 32 bit; Eq. 5: 3 R E N_s F; FedNCM's head: one Eq. 3 round.
    from embedcache.backbones import create_backbone

    bb = create_backbone("tiny-staged")
    P, D = sum(p.numel() for p in bb.trainable().parameters()), bb.feature_dim
    C, K, R = len(m.classes), len(m.clients), 2
    n_train = sum(len(c.train) for c in m.clients)
    pu = res["paper_units"]
    assert (pu["LL_in"], pu["LL_out"], pu["clients_K"], pu["P_trained_base_params"]) == (D, C, K, P)
    assert pu["ft_comm_bytes"] == pytest.approx(2 * (C * D + P) * K * R * 4)
    assert pu["ft_compute_F"] == 3 * R * 1 * n_train
    assert pu["head_comm_bytes"] == pytest.approx(2 * C * D * K * 4) and pu["head_compute_F"] == n_train


@pytest.mark.parametrize("head", ["fed3r", "fedcof"])
def test_fed3r_and_fedcof_ft_round0_equals_the_head_on_the_store(setup, tmp_path, head):
    """Any head whose state defines a linear classifier (AlgorithmBase.linear_head) starts
    fine-tuning: round 0 is that head's accuracy as `fedheads train` reports it."""
    from fedheads.run.train import TrainOptions, train_run

    root, m = setup
    res = finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "ft",
                       _opts(heads=(head,), rounds=1))
    ref = train_run(str(root / "s.zarr"), ["tiny-staged"], head,
                    TrainOptions(rounds=1, seeds=(0,), progress=False, device="cpu"), tmp_path / "head")
    ck = torch.load(tmp_path / "ft" / "state" / "seed0.ckpt.pt", weights_only=True)
    live0 = dict(zip([c.name for c in m.clients], (100 * a for a in ck["history"][0]["accuracy"])))
    assert live0 == pytest.approx({c: v["mean"] for c, v in ref["per_client"].items()}, abs=1e-9)
    assert res["algorithm"] == f"{head}+ft" and res["stages"][0]["method"] == head
    assert res["stages"][0]["accuracy"]["mean"] == pytest.approx(ref["accuracy"]["mean"], abs=1e-9)
    assert res["paper_units"]["head_comm_bytes"] > 0


def test_finetune_heads_are_the_registered_linear_heads():
    """--head takes every registered algorithm that defines a linear head (the table's and any
    discovered one: AFL, GH-OFL, FedCGS need no entry), plus LP and random."""
    from fedheads.algorithms import create_algorithm, list_algorithms
    from fedheads.core.protocol import AlgorithmBase
    from fedheads.run.checks import FINETUNE_HEADS, finetune_heads

    linear = {i.name for i in list_algorithms()
              if type(create_algorithm(i.name)).linear_head is not AlgorithmBase.linear_head}
    assert set(FINETUNE_HEADS) - {"lp", "random"} <= linear
    assert set(finetune_heads(sorted(linear))) == linear | {"lp", "random"}


def test_cache_first_equals_live_frozen_prefix(setup, tmp_path):
    root, _ = setup
    kw = dict(trainable="after:stem", augment=False, heads=("random",))
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "cache", _opts(**kw))
    finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "live",
                 _opts(live_prefix=True, **kw))
    a, b = _final_state(tmp_path / "cache"), _final_state(tmp_path / "live")
    assert set(a) == set(b) and all(k.startswith(("stage:block", "head")) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_lr_warmup_scales_the_first_rounds_client_lr(setup, tmp_path):
    """--set warmup_rounds=K (FedNCM paper Sec. 4.2's proposed warm-up): FT round r < K runs at
    lr (r+1)/(K+1); with plain SGD, one warm-up round at lr 0.1 is one round at lr 0.05."""
    cfg = FTConfig(lr=0.3, warmup_rounds=2)
    assert [cfg.client_lr(r) for r in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.3])
    assert FTConfig(lr=0.3).client_lr(0) == 0.3
    with pytest.raises(UserError, match="warmup_rounds -1: must be >= 0"):
        FTConfig(warmup_rounds=-1)
    root, _ = setup
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    ft = dict(batch_size=4)
    finetune_run(*args, tmp_path / "warm", _opts(rounds=1, ft=FTConfig(lr=0.1, warmup_rounds=1, **ft)))
    finetune_run(*args, tmp_path / "half", _opts(rounds=1, ft=FTConfig(lr=0.05, **ft)))
    finetune_run(*args, tmp_path / "full", _opts(rounds=1, ft=FTConfig(lr=0.1, **ft)))
    warm, half, full = (_final_state(tmp_path / d) for d in ("warm", "half", "full"))
    assert live_doubles.digest(warm) == live_doubles.digest(half) != live_doubles.digest(full)


def test_sums_then_finalize_equal_the_stacked_server_step():
    from fedheads.algorithms.pfl_common import DeltaMessage, GlobalModel
    from fedheads.core.protocol import RoundCtx

    g = torch.Generator().manual_seed(0)
    start = GlobalModel({"w": torch.randn(3, 2, generator=g)}, {"bn": torch.rand(2, generator=g)})
    msg = DeltaMessage({"w": torch.randn(4, 3, 2, generator=g)}, {"bn": torch.randn(4, 2, generator=g)},
                       torch.tensor([1.0, 5.0, 2.0, 7.0], dtype=torch.float64))
    ctx = RoundCtx(0, 0, torch.arange(4), 4)
    for server in ("fedavg", "fedadam"):
        alg = FineTune(FTConfig(server=server))
        ss = alg.init(start)
        stacked, _ = alg.server_aggregate(ss, msg, ctx)
        sums = alg.sums_init(ss)
        for i in range(4):  # one client at a time, as the driver does
            sums = alg.sums_add(sums, DeltaMessage({"w": msg.delta["w"][i:i + 1]}, {"bn": msg.buffer_delta["bn"][i:i + 1]},
                                                   msg.weight[i:i + 1]))
        streamed, _ = alg.server_finalize(ss, sums, ctx)
        torch.testing.assert_close(stacked.model.params["w"], streamed.model.params["w"])
        w = msg.weight.float() / msg.weight.sum().float()
        want_bn = start.buffers["bn"] + (w.view(-1, 1) * msg.buffer_delta["bn"]).sum(0)
        torch.testing.assert_close(streamed.model.buffers["bn"], want_bn)
        if server == "fedavg":
            want = start.params["w"] + (w.view(-1, 1, 1) * msg.delta["w"]).sum(0)
            torch.testing.assert_close(streamed.model.params["w"], want)


def test_fedavgm_server_equals_torch_sgd_momentum_and_flsim_buffers():
    """--server fedavgm: two rounds of server momentum equal torch.optim.SGD(momentum) stepping on
    the pseudo-gradient -Delta (FLSim's FedAvgWithLR); server_buffers "flsim" keeps the BatchNorm
    buffers under fedadam/fedavgm (FLSim steps parameters only) and averages them under fedavg."""
    from fedheads.algorithms.pfl_common import DeltaMessage, GlobalModel
    from fedheads.core.protocol import RoundCtx

    g = torch.Generator().manual_seed(1)
    start = GlobalModel({"w": torch.randn(3, 2, generator=g)}, {"bn": torch.rand(2, generator=g)})
    msgs = [DeltaMessage({"w": torch.randn(2, 3, 2, generator=g)}, {"bn": torch.randn(2, 2, generator=g)},
                         torch.tensor([1.0, 3.0], dtype=torch.float64)) for _ in range(2)]
    ctx = RoundCtx(0, 0, torch.arange(2), 2)
    alg = FineTune(FTConfig(server="fedavgm", server_lr=0.5, server_momentum=0.8))
    ss = alg.init(start)
    ref = torch.nn.Parameter(start.params["w"].clone())
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.8)
    w = torch.tensor([0.25, 0.75])
    for msg in msgs:
        ss, _ = alg.server_aggregate(ss, msg, ctx)
        ref.grad = -(w.view(-1, 1, 1) * msg.delta["w"]).sum(0)
        opt.step()
    torch.testing.assert_close(ss.model.params["w"], ref.detach())
    for server, kept in (("fedavgm", True), ("fedadam", True), ("fedavg", False)):
        alg = FineTune(FTConfig(server=server, server_buffers="flsim"))
        got, _ = alg.server_aggregate(alg.init(start), msgs[0], ctx)
        want = start.buffers["bn"] if kept else start.buffers["bn"] + (w.view(-1, 1) * msgs[0].buffer_delta["bn"]).sum(0)
        torch.testing.assert_close(got.model.buffers["bn"], want)
    with pytest.raises(UserError, match="server_buffers"):
        FTConfig(server_buffers="keep")
    with pytest.raises(UserError, match="server_momentum"):
        FineTune(FTConfig(server="fedavgm", server_momentum=1.0))


def test_resume_continues_to_the_same_weights(setup, tmp_path):
    root, _ = setup
    args = (root / "manifest.json", str(root / "s.zarr"), "tiny-staged")
    finetune_run(*args, tmp_path / "straight", _opts(rounds=3))
    finetune_run(*args, tmp_path / "split", _opts(rounds=1))
    finetune_run(*args, tmp_path / "split", _opts(rounds=3, resume=True))
    a, b = _final_state(tmp_path / "straight"), _final_state(tmp_path / "split")
    assert live_doubles.digest(a) == live_doubles.digest(b)
    exported = [(tmp_path / d / "state" / "seed0.backbone.pt").read_bytes() for d in ("straight", "split")]
    assert exported[0] == exported[1]  # the ckpt: export depends on the weights only (same cache key)
    r1 = json.loads((tmp_path / "split" / "results.json").read_text())
    assert r1["timing"]["per_seed"][0]["resumed_from_round"] == 1


def test_kill_minus_9_then_resume_is_identical(setup, tmp_path):
    root, _ = setup
    ref, killed = live_doubles.kill_after_round_2_then_resume(
        root, tmp_path, "rounds=4, ft=FTConfig(lr=0.05, batch_size=4)")
    assert live_doubles.digest(_final_state(ref)) == live_doubles.digest(_final_state(killed))


def test_bad_input_is_one_line(setup, tmp_path):
    root, m = setup
    args = (root / "manifest.json", str(root / "s.zarr"))
    with pytest.raises(UserError, match="no cut 'nope'.*cut points: stem, block"):
        finetune_run(*args, "tiny-staged", tmp_path / "a", _opts(trainable="after:nope"))
    with pytest.raises(UserError, match="trainable 'sideways'"):
        finetune_run(*args, "tiny-staged", tmp_path / "b", _opts(trainable="sideways"))
    with pytest.raises(UserError, match="Random baseline"):
        finetune_run(*args, "tiny-staged", tmp_path / "c", _opts(pretrained=False))
    # a store extracted with other weights is refused, never silently recomputed
    other = root / "other.zarr"
    (root / "other.json").write_text((root / "manifest.json").read_text())
    from embedcache.backbones.base import TorchBackbone

    def factory(name, wd, dev):
        bb = live_doubles.build()
        return TorchBackbone(name, bb.module, weights_sha256="0" * 64, preprocess=bb.preprocess)
    extract(m, ExtractConfig(backbones=("tiny-staged",), store=str(other), progress=False), backbone_factory=factory)
    with pytest.raises(UserError, match="other weights"):
        finetune_run(root / "manifest.json", str(other), "tiny-staged", tmp_path / "d", _opts())
    assert not (tmp_path / "d" / "results.json").exists()
    # a finished run directory is not overwritten silently
    finetune_run(*args, "tiny-staged", tmp_path / "e", _opts(rounds=1))
    with pytest.raises(UserError, match=r"holds a fedncm\+ft run.*--resume.*--overwrite"):
        finetune_run(*args, "tiny-staged", tmp_path / "e", _opts(rounds=1))


def test_cli_finetune_prints_one_line_errors(setup, tmp_path):
    root, _ = setup
    env = kill_helpers.subprocess_env()
    p = subprocess.run([sys.executable, "-m", "fedheads.cli", "finetune", "--manifest", str(root / "manifest.json"),
                        "--store", str(root / "s.zarr"), "--backbone", "no-such-backbone", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "no-such-backbone" in p.stderr


@pytest.mark.shared
def test_real_cifar_resnet_round0_and_cache_first_equality(shared, cifar_weights, tmp_path):
    """resnet20-cifar10 on real Office-Caltech-10 images: FedNCM+FT's round 0 equals FedNCM on
    the store per client, and after:layer2 from the cached maps equals the live frozen prefix."""
    from fedheads.run.train import TrainOptions, train_run

    m = make_manifest(shared / "data" / "office_caltech10", test_every=3, domains=("dslr", "webcam"),
                      classes=("backpack", "bike", "mug"), per_class=9)
    save_manifest(m, tmp_path / "m.json")
    store = str(tmp_path / "s.zarr")
    extract(m, ExtractConfig(backbones=("resnet20-cifar10", "resnet20-cifar10@layer2"), store=store,
                             weights_dir=str(cifar_weights.parent), progress=False))
    kw = dict(weights_dir=str(cifar_weights.parent), ft=FTConfig(batch_size=8))
    finetune_run(tmp_path / "m.json", store, "resnet20-cifar10", tmp_path / "ft", _opts(**kw))
    ncm = train_run(store, ["resnet20-cifar10"], "fedncm", TrainOptions(rounds=1, seeds=(0,), progress=False,
                                                                       device="cpu"), tmp_path / "ncm")
    ck = torch.load(tmp_path / "ft" / "state" / "seed0.ckpt.pt", weights_only=True)
    live0 = {c.name: 100 * a for c, a in zip(m.clients, ck["history"][0]["accuracy"])}
    assert live0 == pytest.approx({c: v["mean"] for c, v in ncm["per_client"].items()}, abs=1e-9)
    cut = dict(kw, trainable="after:layer2", augment=False)
    finetune_run(tmp_path / "m.json", store, "resnet20-cifar10", tmp_path / "cache", _opts(**cut))
    finetune_run(tmp_path / "m.json", store, "resnet20-cifar10", tmp_path / "live", _opts(live_prefix=True, **cut))
    a, b = _final_state(tmp_path / "cache"), _final_state(tmp_path / "live")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
