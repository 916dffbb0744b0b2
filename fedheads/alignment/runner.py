"""`fedheads feddra`: FedDRA and its baselines on paired data, one run directory per method.

    RUN_DIR/results.json     the results contract of `fedheads train` (per client = text->image
                             R@1 in percent) + lambda, retrieval, stages, compute (written last)
    RUN_DIR/config.json      the whole resolved configuration
    RUN_DIR/metrics.csv      round x seed x client: retrieval metrics (percent), lambda, v, s
    RUN_DIR/summary.md, retrieval_per_round.png, retrieval_per_client.png, lambda.png
    RUN_DIR/state/seed<S>.ckpt.pt       checkpoint after every round (global model, lambda, history)
    RUN_DIR/encoders/image-seed<S>.pt   the trained encoders as `ckpt:` checkpoints (vl.export_encoder)
    RUN_DIR/encoders/text-seed<S>.pt

Several `--baseline` values write one directory each under RUN_DIR plus a combined results.json
and summary.md (the layout of `fedheads compare`). Presets (FedDRA Table 2 / Table 3):
feddra (all parts); fedavg, the paper's FedAvg baseline (Sec. 5.1.3, McMahan et al. 2017): plain
one-stage averaging, i.e. rho = 0, mu = 0 and no two-stage schedule (the schedule is one of FedDRA's
own components, Sec. 4.2, ablated in Table 3); fedavg-two-stage (rho = 0, mu = 0 with FedDRA's
two-stage schedule kept: what `fedavg` meant before); fedprox (fedavg + proximal term; the
two-stage variant is `fedavg-two-stage --set prox_mu=0.01`); no-two-stage, no-constraint (mu = 0),
no-dro (rho = 0); each keeps every other option.

Budget of the one-stage baselines: the same R rounds of E local steps per client as every method,
E being the paper's "50 batches per round" (Sec. 5.1.1), all of them on every parameter (FedDRA's
stage 2 alone, as the Table 3 "w/o two-stage" row). FedDRA under the per-stage reading of E runs E
more steps per round on the alignment modules only (stage 1, encoders frozen): one-stage FedAvg
gets the same rounds and the same E full-model steps per client and round (the paper's budget for
every method), not FedDRA's extra module-only steps; a step-matched FedAvg (2E full-model steps) is
`--baseline fedavg --set steps=2E`, run on its own. Every preset averages with Alg. 1's 1/N unless `aggregation = "samples"`
(n_i / sum_j n_j weights, FedDRAConfig.aggregation).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.alignment import dro, vl
from fedheads.alignment import report as feddra_report
from fedheads.alignment.algorithm import FedDRA, FedDRAConfig
from fedheads.alignment.driver import FDRun, feddra_checkpoint, run_feddra
from fedheads.alignment.model import DualEncoder, ModuleShape
from fedheads.alignment.pairs import PairClient, cache_from_store, check_paired, pair_clients
from fedheads.alignment.probe import ProbeOptions, run_probe
from fedheads.core.config import setting
from fedheads.finetuning.heads import check_store
from fedheads.report import results as report
from fedheads.run import rundir
from fedheads.run.checks import check_finite, check_seeds, check_trained_state
from fedheads.run.commands import FedDRARun
from fedheads.run.environment import machine
from fedheads.run.load import resolve_device
from fedheads.run.rundir import RunDir, jsonable
from fedheads.run.settings import Part, settings_values, split_settings

BASELINES: dict[str, dict[str, Any]] = {
    "feddra": {},
    "fedavg": {"mu": 0.0, "rho": 0.0, "two_stage": False},  # the paper's FedAvg: one stage (see the docstring)
    "fedavg-two-stage": {"mu": 0.0, "rho": 0.0},  # FedDRA's schedule without L_C and DRO
    "fedprox": {"mu": 0.0, "rho": 0.0, "two_stage": False},  # + prox_mu 0.01 unless given (Li et al. 2020's grid has 0.01)
    "no-two-stage": {"two_stage": False},
    "no-constraint": {"mu": 0.0},
    "no-dro": {"rho": 0.0},
}
FEDPROX_MU = 0.01
# `fedheads feddra --preset`: defaults for the options a user does not give (CLI parameter names).
# "paper" keeps the paper's E = 50 steps x 25 rounds and trains both encoders in stage 2 (hours on
# a CPU). "quick" is a short run on 2 CPU cores that still learns (measured on the
# offline Office-Caltech-10 setting with resnet20-cifar10@layer3 and minilm-l6-v2:32, see
# benchmarks/bench_feddra.py): 4 rounds of E = 5 steps at B = 32, both stages every round, the
# text encoder frozen in stage 2 (its 22.7M parameters dominate a live CPU step; its token states
# then always come from the store) and the image encoder trained whole. Measured once, seed 0, on 2
# cores shared with other jobs (load average 6-8): text->image R@1 10.1 % over clients (worst 6.3 %),
# R@5 40.4 % (worst 31.6 %) against chance 1.56 % / 7.8 % (batches of 64), from 1.2 % at round 0;
# 11.3 minutes wall under that load (round 1, the only one reading the cache: 1.5 minutes).
# The same preset, seed 0, all methods (benchmarks/results/feddra.json): t2i R@1 mean / worst client
# FedDRA 10.1 / 6.3, FedAvg with FedDRA's two-stage schedule 14.3 / 7.8 (the paper's one-stage FedAvg: 11.2 / 7.6,
# re-run 2026-11-27), no-two-stage 8.8 / 6.3, no-constraint 12.7 / 10.9, no-dro 10.6 / 5.0:
# at 20 local steps FedDRA does NOT beat FedAvg (L_C with mu = 5 slows a short run); `quick` shows the
# method learns, it does not reproduce the paper's comparison (that needs the paper preset).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "quick": {"rounds": 4, "steps": 5, "batch_size": 32, "text_trainable": "frozen"},
}
DEFAULT_CUTS = {"efficientnet-lite0": "blocks.6"}  # FedDRA notes section 4: 49 x 320 tokens at 224 px


def apply_baseline(cfg: FedDRAConfig, name: str) -> FedDRAConfig:
    """The preset `name` on top of `cfg` (every option it does not name is kept)."""
    if name not in BASELINES:
        raise UserError(f"--baseline {name!r}: use one of {', '.join(BASELINES)}")
    over = dict(BASELINES[name])
    if name == "fedprox" and cfg.prox_mu == 0:
        over["prox_mu"] = FEDPROX_MU
    rho = over.pop("rho", None)
    if rho is not None:
        cfg = dataclasses.replace(cfg, dro=dataclasses.replace(cfg.dro, rho=rho))
    return dataclasses.replace(cfg, **over)


@dataclass(frozen=True)
class FedDRAOptions(FedDRARun):
    """What `fedheads feddra` runs with besides manifest, store, encoders and output: the run
    (fedheads.run.commands.FedDRARun) and FedDRA's settings. The fields below (with FedDRAConfig's
    and DROConfig's) are the --set keys (SETTINGS); the preset's values, then the run's `settings`,
    are applied on top of them when the options are built (and then cleared), and `rounds` resolved
    (given, else the preset's, else FedDRAConfig's)."""

    fd: FedDRAConfig = field(default_factory=FedDRAConfig)
    image_trainable: str = setting("all", "stage 2: all (paper) | after:STAGE (CPU deviation) | frozen")
    text_trainable: str = setting("all", "stage 2: all (paper) | after:STAGE | frozen")
    bn: str = setting("frozen", "image BatchNorm in stage 2: frozen statistics (the paper's ViT/BERT have none) | train")
    shape: ModuleShape = field(default_factory=ModuleShape)
    augment: bool = setting(True, "stage 2: the image encoder's training augmentation")
    stage1_inputs: str = setting("auto", "stale caches: auto | reencode | live (feddra_driver)")
    probe: ProbeOptions | None = setting(None, "the few-shot probe on an out-of-distribution manifest (from "
                                         "probe_manifest, probe_shots and probe_draws when not given)")

    def __post_init__(self) -> None:
        preset = dict(PRESETS[self.preset])
        rounds = self.rounds if self.rounds is not None else preset.pop("rounds", self.fd.rounds)
        preset.pop("rounds", None)
        fd, dr, top = split_settings("feddra", SETTINGS, [*preset.items(), *self.settings])
        cfg = replace(self.fd, dro=replace(self.fd.dro, **dr), **fd, rounds=rounds)
        probe = self.probe
        if probe is None and self.probe_manifest:
            probe = ProbeOptions(manifest=self.probe_manifest, shots=self.probe_shots, draws=self.probe_draws)
        for k, v in {"fd": cfg, **top, "rounds": cfg.rounds, "settings": (), "probe": probe}.items():
            object.__setattr__(self, k, v)
        check_seeds(self.seeds)
        check_finite(self)
        self.check_schedule()


# `fedheads feddra --set KEY=VALUE`: FedDRA's objective, schedule and optimisation (FedDRAConfig,
# `rounds` being --rounds), its DRO step (DROConfig) and the encoders' stage-2 choices, flat keys
SETTINGS = (Part(FedDRAConfig, exclude=("rounds",)), Part(dro.DROConfig),
            Part(FedDRAOptions, ("image_trainable", "text_trainable", "bn", "augment", "stage1_inputs")))


def feddra_options(run: FedDRARun | None = None, **kw: Any) -> FedDRAOptions:
    """FedDRAOptions of a run (its preset and --set items applied) and any of its fields as keywords."""
    base = {f.name: getattr(run, f.name) for f in fields(FedDRARun)} if run is not None else {}
    return FedDRAOptions(**{**base, **kw})


def feddra_settings(opts: FedDRAOptions) -> dict[str, Any]:
    """{key: value} of every `--set` key of the run `opts` describes (the dump's `set:`)."""
    return settings_values(SETTINGS, (opts.fd, opts.fd.dro, opts))


def _image_cut(staged: Any, name: str, cut: str | None) -> str:
    if cut is not None:
        return cut
    if name in DEFAULT_CUTS:
        return DEFAULT_CUTS[name]
    maps = [c for c in staged.cut_points() if len(staged.stage_output_shape(c)) in (2, 3)]
    if not maps:
        raise UserError(f"--image-encoder {name}: no cut gives token states; it cannot feed FedDRA's alignment module")
    return maps[-1]


@dataclass
class _Setup:
    manifest: Any
    image_bb: Any
    text_bb: Any
    cut: str
    text_cut: str
    clients: list[PairClient]
    device: torch.device
    needs_text: bool
    weights_dir: str | None


def _setup(manifest: Any, store: str | None, image_encoder: str, text_encoder: str,
           opts: FedDRAOptions, cfgs: Sequence[FedDRAConfig]) -> _Setup:
    """Every input check before any training or any file is written."""
    from embedcache.backbones import create_backbone
    from embedcache.manifest import load_manifest
    from embedcache.sources import open_source

    m = load_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest
    check_paired(m)
    device = resolve_device(opts.device)
    # the text encoder first: opening it is cheap, while an image encoder may first have to be built
    # (digitnet-builtin pre-trains on a fresh machine), so a mistyped text name fails at once
    text_bb = vl.open_text_encoder(text_encoder, opts.weights_dir)
    bb = create_backbone(image_encoder, weights_dir=opts.weights_dir, device="cpu")
    try:
        staged = bb.trainable()
    except UserError as exc:
        raise UserError(f"--image-encoder {image_encoder}: FedDRA needs a trainable encoder with token states "
                        f"({exc})") from None
    cut = _image_cut(staged, image_encoder, opts.image_cut)
    tcut = vl.text_cut(text_bb, opts.text_cut)
    stage2 = any(2 in p for cfg in cfgs for p in cfg.plan())
    needs_text = stage2 and opts.text_trainable != "frozen"
    if needs_text:
        vl.text_trainable(text_bb)  # UserError naming the encoder when it cannot train
    if stage2 and opts.image_trainable == "frozen" and opts.text_trainable == "frozen":
        raise UserError("stage 2 with both encoders frozen trains nothing new; use --set schedule=sequential "
                        "--set stage1_rounds=R (stage 1 only) or let an encoder train")
    DualEncoder(staged, cut, vl.FrozenText(text_bb, tcut), text_bb.token_dim, image_trainable=opts.image_trainable,
                text_trainable="frozen", bn=opts.bn, text_cut=tcut)  # cut and trainable specs checked here
    clients = pair_clients(m, open_source(m.source), bb.transform, text_bb, opts.num_workers, device)
    if store is not None:
        img_name = f"{image_encoder}@{cut}"
        check_store(store, m, create_backbone(img_name, weights_dir=opts.weights_dir), img_name, cut=cut,
                    map_shape=staged.stage_output_shape(cut))
        txt_name = f"{text_encoder}@{tcut}"
        check_store(store, m, create_backbone(txt_name, weights_dir=opts.weights_dir), txt_name, cut=tcut)
        cache_from_store(clients, m, store, img_name, txt_name)
    return _Setup(m, bb, text_bb, cut, tcut, clients, device, needs_text, opts.weights_dir)


@rundir.holds_lock
def feddra_run(manifest: str | Path | Any, store: str | None, image_encoder: str, text_encoder: str,
               out: str | Path, opts: FedDRAOptions = FedDRAOptions()) -> dict[str, Any]:
    """Python API of `fedheads feddra`: returns results.json (combined when several baselines)."""
    if not opts.baselines or len(set(opts.baselines)) != len(opts.baselines):
        raise UserError(f"--baseline {','.join(opts.baselines)}: name each method once")
    cfgs = {b: apply_baseline(opts.fd, b) for b in opts.baselines}
    su = _setup(manifest, store, image_encoder, text_encoder, opts, list(cfgs.values()))
    multi = len(cfgs) > 1
    rd = RunDir(out, list(cfgs) if multi else ())
    rd.check(opts.overwrite, opts.resume, resume_needs_checkpoints=False)  # every refusal before any training
    rd.begin(opts.overwrite and not opts.resume)
    subs = {b: rd.member(b) if multi else rd for b in cfgs}
    results = {b: _one_method(b, cfg, su, store, image_encoder, text_encoder, subs[b], opts)
               for b, cfg in cfgs.items()}
    if not multi:
        return results[opts.baselines[0]]
    combined = {"algorithms": results, "image_encoder": image_encoder, "text_encoder": text_encoder,
                "store": None if store is None else str(store), "manifest_hash": su.manifest.content_hash}
    feddra_report.write_comparison(list(results.values()), rd)
    return rd.finish(combined)


def _build(su: _Setup, opts: FedDRAOptions, seed: int, device: torch.device) -> DualEncoder:
    text = vl.text_trainable(su.text_bb) if su.needs_text else vl.FrozenText(su.text_bb, su.text_cut)
    net = DualEncoder(su.image_bb.trainable(), su.cut, text, su.text_bb.token_dim, shape=opts.shape, text_cut=su.text_cut,
                      image_trainable=opts.image_trainable,
                      text_trainable=opts.text_trainable if su.needs_text else "frozen", bn=opts.bn, seed=seed)
    net.to(device)
    if device.type == "cuda":
        net.image.to(memory_format=torch.channels_last)
    return net


def _one_method(name: str, cfg: FedDRAConfig, su: _Setup, store: str | None, image_encoder: str,
                text_encoder: str, rd: RunDir, opts: FedDRAOptions) -> dict[str, Any]:
    run_cfg = {"manifest_hash": su.manifest.content_hash, "image_encoder": image_encoder,
               "image_weights_sha256": su.image_bb.weights_sha256, "text_encoder": text_encoder,
               "text_weights_sha256": su.text_bb.weights_sha256, "image_cut": su.cut, "text_cut": su.text_cut, "baseline": name,
               "feddra": jsonable(cfg), "image_trainable": opts.image_trainable,
               "text_trainable": opts.text_trainable, "bn": opts.bn, "shape": jsonable(opts.shape),
               "augment": opts.augment, "stage1_inputs": opts.stage1_inputs, "store_cache": store is not None}
    alg = FedDRA(cfg)
    runs: list[FDRun] = []
    per_seed, probes, exported = [], [], []
    t_all, c_all = time.perf_counter(), time.process_time()
    for seed in opts.seeds:
        net = _build(su, opts, seed, su.device)
        glob = copy.deepcopy(net)
        ck = feddra_checkpoint(rd.file(f"state/seed{seed}.ckpt.pt"), {**run_cfg, "seed": seed})
        run = run_feddra(alg, net, glob, su.clients, seed=seed, device=su.device, checkpoint=ck, resume=opts.resume,
                         evaluates=opts.evaluates, augment=opts.augment, stage1_inputs=opts.stage1_inputs,
                         progress=opts.progress)
        check_trained_state({"model": run.state.model}, name, seed)
        runs.append(run)
        glob.load_state({**run.state.model.params, **run.state.model.buffers})
        exported.append(_export(glob, su, rd, seed, image_encoder, text_encoder))
        probes.append(run_probe(opts.probe, glob, su, rd.path, seed, exported[-1]) if opts.probe else None)
        per_seed.append(feddra_report.seed_result(run, net, su.clients, seed))
    result = report.summarise_runs(per_seed, algorithm=name, backbones=[image_encoder, text_encoder],
                                   rounds=cfg.rounds, extra=feddra_report.extra(runs, per_seed, cfg, su, opts,
                                                                                probes, exported))
    result["timing"].update(wall_seconds=time.perf_counter() - t_all, cpu_seconds=time.process_time() - c_all,
                            machine=machine(su.device))
    config = {"algorithm": name, "store": None if store is None else str(store), "options": jsonable(opts),
              "run": run_cfg}
    rd.write_json("config.json", config)
    rd.write_csv("metrics.csv", *_metrics_table(runs, opts.seeds, su.clients))
    feddra_report.write_run(result, rd)
    return rd.finish(result)  # last: marks the directory complete


def _export(glob: DualEncoder, su: _Setup, rd: RunDir, seed: int, image_encoder: str, text_encoder: str) -> dict:
    """The trained encoders as `ckpt:` files (contract 3f, written atomically by vl.export_encoder),
    loadable by `embedcache extract`."""
    note = (f"fedheads feddra, seed {seed}, {len(su.clients)} clients, manifest {su.manifest.content_hash[:12]}, "
            f"image cut {su.cut}, text cut {su.text_cut}")
    paths = {"image": rd.file(f"encoders/image-seed{seed}.pt"), "text": rd.file(f"encoders/text-seed{seed}.pt")}
    shas = {"image": vl.export_encoder(paths["image"], getattr(su.image_bb, "base_name", image_encoder), glob.image,
                                       note)}
    if su.needs_text:
        shas["text"] = vl.export_encoder(paths["text"], getattr(su.text_bb, "registry_base", text_encoder), glob.text,
                                         note)
    return {k: {"path": str(paths[k]), "sha256": v} for k, v in shas.items()}


def _metrics_table(runs: Sequence[FDRun], seeds: Sequence[int],
                   clients: Sequence[PairClient]) -> tuple[list[str], list[list[Any]]]:
    """metrics.csv (header, rows): round x seed x client retrieval metrics (percent), lambda, v, s."""
    from fedheads.alignment.evaluation import METRICS

    rows = []
    for seed, run in zip(seeds, runs):
        for rec in run.rounds:
            for c in clients:
                ret = rec.retrieval[c.index] if rec.retrieval else {}
                vals = ["" if ret.get(k) is None or ret[k] != ret[k] else round(100 * ret[k], 4) for k in METRICS]
                extra = [rec.lam[c.index] if rec.lam else "", rec.v[c.index] if rec.v else "",
                         rec.scale[c.index] if rec.scale else ""]
                rows.append([rec.round, seed, c.name, *vals, *extra])
    return ["round", "seed", "client", *METRICS, "lambda", "v", "scale"], rows


def summary_line(res: dict[str, Any]) -> str:
    """One line for the CLI."""
    wc = res.get("worst_client", {}).get("t2i_r1", {})
    return (f"{res['algorithm']}: text->image R@1 {res['accuracy_cell']} (worst client "
            f"{wc.get('mean', float('nan')):.2f}), final lambda {np.round(res['lambda']['final_mean'], 3).tolist()}")


