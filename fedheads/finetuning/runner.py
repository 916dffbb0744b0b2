"""`fedheads finetune`: stage 1 on the store, stage 2 live, one run directory per method.

    RUN_DIR/results.json       the results contract of `fedheads train` + stages, paper units,
                               timing, and the per-round curves of FedNCM Figure 1 (written last)
    RUN_DIR/config.json        the whole resolved configuration
    RUN_DIR/metrics.csv        round x seed x client accuracy (percent; round 0 = before FT)
    RUN_DIR/summary.md, accuracy_per_round.png, per_client.png, figure1.png
    RUN_DIR/state/seed<S>.ckpt.pt   checkpoint after every round (weights_only loadable); the
                               last one holds the final global model
    RUN_DIR/state/seed<S>.backbone.pt  the final fine-tuned backbone (no head) as a `ckpt:` file
                               (docs/contracts.md 3f): `embedcache extract --backbones
                               ckpt:RUN_DIR/state/seed0.backbone.pt` caches its features

Several `--head` values write one such directory per method under RUN_DIR plus a combined
summary.md / results.json / figure1.png (FedNCM paper Figure 1: accuracy vs rounds, vs
communication, vs computation, one curve per method).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.core.config import setting
from fedheads.core.protocol import HeadArch
from fedheads.finetuning import plots
from fedheads.finetuning.adapters.base import AdapterConfig, AdapterFT
from fedheads.finetuning.algorithm import FineTune, FTConfig, split_state
from fedheads.finetuning.data import cached_clients, image_clients
from fedheads.finetuning.driver import FTRun, finetune_checkpoint, run_finetune
from fedheads.finetuning.heads import HeadResult, check_store, head_from_store
from fedheads.finetuning.model import LiveNet, Trainable, count_values, reinitialise
from fedheads.finetuning.rounds import seed_timing
from fedheads.report import communication as comm
from fedheads.report import plotting
from fedheads.report import results as report
from fedheads.report.metrics import nanmean
from fedheads.run import rundir
from fedheads.run.checks import check_finetune_heads, check_finite, check_seeds, check_trained_state
from fedheads.run.commands import FinetuneRun
from fedheads.run.environment import machine
from fedheads.run.load import resolve_device
from fedheads.run.rundir import RunDir, jsonable
from fedheads.run.settings import Part, settings_values, split_settings

METHOD_NAMES = {"fedncm": "fedncm+ft", "lp": "lp+ft", "random": "ft"}


def method_name(head: str, adapter: str = "none") -> str:
    """The run's name for a stage-1 head: HEAD+ft (FedNCM+FT, Fed3R+FT, ...), "ft" for the random
    head; with adapters HEAD+ADAPTER (fedncm+lora, fedncm+ffa-lora, ...), ADAPTER from a random head."""
    if adapter != "none":
        return adapter if head == "random" else f"{head}+{adapter}"
    return METHOD_NAMES.get(head, f"{head}+ft")


@dataclass(frozen=True)
class FinetuneOptions(FinetuneRun):
    """What `fedheads finetune` runs with besides the manifest, store, backbone and output: the run
    (fedheads.run.commands.FinetuneRun) and the method. The method's fields below are the --set keys
    (SETTINGS: with FTConfig's); the run's `settings` are applied on top of them when the options
    are built (and then cleared: the fields hold the resolved values)."""

    head_rounds: int = setting(5, "LP rounds of stage 1 (FedNCM App. C.2, Table 6: 5 and 10)",
                               source="FedNCM App. C.2; FedNCM Table 6")
    ft: FTConfig = setting(doc="client/server optimisation", default_factory=FTConfig)
    trainable: str = setting("all", "all | after:BLOCK | head")
    bn: str = setting("train", "train (paper's code: FLSim .train()) | frozen (pre-trained statistics)")
    live_prefix: bool = setting(False, "after:BLOCK / head: run the frozen prefix live instead of reading the cache")
    pretrained: bool = setting(True, "False: the paper's Random baseline (all weights re-initialised)")
    augment: bool = setting(True, "live images: the backbone's training augmentation")
    ncm_bias: str = setting("zero", "FedNCM head bias: zero (paper) | random (authors' code)")
    lp_settings: tuple[tuple[str, Any], ...] = setting((), "fedheads `lp` config fields for stage 1")
    adapter: str = setting("none", "none (the stages after the cut train) | lora (FedIT) | ffa-lora | fedsa-lora | flora: "
                           "low-rank adapters on the layers after the cut, the rest frozen "
                           "(fedheads.finetuning.adapters)")
    lora: AdapterConfig = setting(doc="the adapters' rank, alpha, dropout and target layers", default_factory=AdapterConfig)

    def __post_init__(self) -> None:
        if self.settings:
            ft, lora, top = split_settings("finetune", SETTINGS, self.settings)
            for k, v in {"ft": replace(self.ft, **ft), "lora": replace(self.lora, **lora), **top, "settings": ()}.items():
                object.__setattr__(self, k, v)
        check_seeds(self.seeds)
        check_finite(self)
        self.check_schedule()
        if self.adapter != "none":
            from fedheads.finetuning.adapters import adapter_algorithms

            if self.adapter not in adapter_algorithms():
                raise UserError(f"adapter {self.adapter!r}: use none or one of {', '.join(adapter_algorithms())}")


# `fedheads finetune --set KEY=VALUE`: the client/server optimisation (FTConfig) and the method's
# stage-1 and backbone choices, flat keys (fedheads.run.settings.Part)
SETTINGS = (Part(FTConfig), Part(AdapterConfig), Part(FinetuneOptions, ("head_rounds", "trainable", "bn", "live_prefix",
                                                                         "pretrained", "augment", "ncm_bias", "adapter")))


def finetune_options(run: FinetuneRun | None = None, **kw: Any) -> FinetuneOptions:
    """FinetuneOptions of a run (its --set items applied) and any of its fields as keywords."""
    base = {f.name: getattr(run, f.name) for f in fields(FinetuneRun)} if run is not None else {}
    return FinetuneOptions(**{**base, **kw})


def finetune_settings(opts: FinetuneOptions) -> dict[str, Any]:
    """{key: value} of every `--set` key of the run `opts` describes (the dump's `set:`)."""
    return settings_values(SETTINGS, (opts.ft, opts.lora, opts))


@rundir.holds_lock
def finetune_run(manifest: str | Path | Any, store: str, backbone: str, out: str | Path,
                 opts: FinetuneOptions = FinetuneOptions()) -> dict[str, Any]:
    """Python API of `fedheads finetune` (the CLI is a thin layer over it): returns results.json."""
    from embedcache.backbones import create_backbone
    from embedcache.manifest import load_manifest

    if not opts.heads:
        raise UserError("--head: name at least one method")
    check_finetune_heads(opts.heads)
    trainable = Trainable.parse(opts.trainable)
    if not opts.pretrained and (trainable.mode != "all" or set(opts.heads) != {"random"}):
        raise UserError("pretrained=false (the Random baseline) trains everything from scratch: use "
                        "--set trainable=all --head random")
    if opts.adapter != "none" and not opts.pretrained:
        raise UserError(f"adapter={opts.adapter} with pretrained=false: adapters adapt pre-trained weights; "
                        "train the Random baseline without adapters")
    m = load_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest
    device = resolve_device(opts.device)
    bb = create_backbone(backbone, weights_dir=opts.weights_dir, device="cpu")
    staged = bb.trainable()  # UserError for backbones that cannot train (TFLite)
    trainable.check(staged)
    names = [c.name for c in m.clients]
    shape = tuple(staged.stage_output_shape(trainable.cut)) if trainable.mode == "after" else None
    if any(h != "random" for h in opts.heads):
        check_store(store, m, bb, backbone)
    probe = LiveNet(staged, trainable, len(m.classes), bn=opts.bn, live_prefix=opts.live_prefix)
    if probe.takes_images:
        from embedcache.sources import open_source

        clients = image_clients(m, open_source(m.source), bb.transform, opts.num_workers, opts.augment, device)
    else:
        in_name = trainable.input_backbone(backbone)
        if in_name != backbone:
            check_store(store, m, create_backbone(in_name, weights_dir=opts.weights_dir), in_name,
                        cut=trainable.cut, map_shape=shape)
        clients = cached_clients(store, in_name, names, [c.domain for c in m.clients], shape)
    multi = len(opts.heads) > 1
    rd = RunDir(out, [method_name(h, opts.adapter) for h in opts.heads] if multi else ())
    # never overwritten silently (docs/contracts.md, section 6): every refusal before any training; a
    # killed run is continued with --resume, replaced with --overwrite
    rd.check(opts.overwrite, opts.resume, resume_needs_checkpoints=False)
    rd.begin(opts.overwrite and not opts.resume)
    subs = {h: rd.member(method_name(h, opts.adapter)) if multi else rd for h in opts.heads}
    results = {}
    for h in opts.heads:
        results[method_name(h, opts.adapter)] = _one_method(h, m, store, bb, backbone, trainable, clients, device,
                                                            subs[h], opts)
    if not multi:
        return results[method_name(opts.heads[0], opts.adapter)]
    combined = {"algorithms": results, "backbone": backbone, "store": str(store), "manifest_hash": m.content_hash}
    rd.save_figure("figure1.png", lambda p: plots.figure1(
        list(results.values()), p, title=plotting.title("Fine-tuning (FedNCM Figure 1)", m.source, backbone)))
    table = report.comparison_markdown(list(results.values()), title=f"{backbone}: fine-tuning, {opts.rounds} rounds")
    rd.write_text("summary.md", f"# Fine-tuning comparison\n\n{table}\n\n![Figure 1](figure1.png)\n")
    return rd.finish(combined)


def _one_method(head: str, m: Any, store: str, bb: Any, backbone: str, trainable: Trainable, clients: list,
                device: torch.device, rd: RunDir, opts: FinetuneOptions) -> dict[str, Any]:
    name = method_name(head, opts.adapter) if opts.pretrained else "random"
    run_cfg = {"manifest_hash": m.content_hash, "backbone": backbone, "weights_sha256": bb.weights_sha256,
               "head": head, "head_rounds": opts.head_rounds if head == "lp" else 0, "ft": jsonable(opts.ft),
               "trainable": trainable.spec, "bn": opts.bn, "live_prefix": opts.live_prefix,
               "pretrained": opts.pretrained, "augment": opts.augment, "ncm_bias": opts.ncm_bias,
               "lp_settings": jsonable(opts.lp_settings), "fraction": opts.fraction,
               # adapters only where used: a plain FT run's checkpoints keep their configuration
               **({"adapter": opts.adapter, "lora": jsonable(opts.lora)} if opts.adapter != "none" else {})}
    per_seed, rows, heads_done, runs = [], [], [], []
    t_all, c_all = time.perf_counter(), time.process_time()
    for seed in opts.seeds:
        staged = bb.trainable()
        net = LiveNet(staged, trainable, len(m.classes), bn=opts.bn, live_prefix=opts.live_prefix)
        if not opts.pretrained:
            reinitialise(net.staged, seed)
        hr = head_from_store(head, store, backbone, [c.name for c in clients], num_classes=len(m.classes),
                             feature_dim=int(staged.feature_dim), seed=seed, head_rounds=opts.head_rounds,
                             ncm_bias=opts.ncm_bias, lp_settings=dict(opts.lp_settings), device="cpu")
        with torch.no_grad():
            net.head.weight.copy_(hr.weight)
            net.head.bias.copy_(hr.bias)
        alg = make_algorithm(opts)
        if isinstance(alg, AdapterFT):
            alg.attach(net, backbone, seed, len(clients))
            alg.privatise(opts.rounds)
        net.to(device)
        if device.type == "cuda":
            net.to(memory_format=torch.channels_last)
        start = alg.start_model(net) if isinstance(alg, AdapterFT) else split_state(net)
        ck = finetune_checkpoint(rd.file(f"state/seed{seed}.ckpt.pt"), {**run_cfg, "seed": seed})
        run = run_finetune(alg, net, start, clients, rounds=opts.rounds, seed=seed,
                           fraction=opts.fraction, evaluates=opts.evaluates, device=device, checkpoint=ck,
                           resume=opts.resume, progress=opts.progress)
        check_trained_state({"model": run.state.model}, name, seed)
        trained_values = alg.trained_values(net) if isinstance(alg, AdapterFT) else \
            count_values(net.trained_state(), net.parameter_keys())
        if isinstance(alg, AdapterFT):
            if not alg.personalised:  # one backbone: the adapters merged into their layers
                _export_adapted(rd.file(f"state/seed{seed}.backbone.pt"), bb, backbone, alg, net, run,
                                f"fedheads finetune {name}, seed {seed}, {opts.rounds} rounds, adapters merged "
                                f"after {trainable.spec}, manifest {m.content_hash[:12]}, from {backbone} "
                                f"(weights {bb.weights_sha256[:12]})")
        elif trainable.mode != "head":  # head-only: the backbone did not change
            _export_backbone(rd.file(f"state/seed{seed}.backbone.pt"), bb, backbone, net, run,
                             f"fedheads finetune {name}, seed {seed}, {opts.rounds} rounds, trainable "
                             f"{trainable.spec}, bn {opts.bn}, manifest {m.content_hash[:12]}, from {backbone} "
                             f"(weights {bb.weights_sha256[:12]})")
        heads_done.append(hr)
        runs.append(run)
        per_seed.append(_seed_result(run, hr, trained_values, clients, seed, opts))
        for rec in run.rounds:
            for c, a in zip(clients, rec.accuracy or []):
                rows.append([rec.round, seed, c.name, "" if a != a else round(100 * a, 4)])
    result = report.summarise_runs(per_seed, algorithm=name, backbones=[backbone], rounds=opts.rounds,
                                   fraction=opts.fraction, extra=_extra(heads_done, runs, per_seed, net, trained_values,
                                                                        clients, trainable, opts, head, alg))
    result["timing"].update(wall_seconds=time.perf_counter() - t_all, cpu_seconds=time.process_time() - c_all,
                            machine=machine(device))
    result["dataset"] = m.source  # plot titles (contract 6)
    result["classes"] = list(m.classes)  # `fedheads predict` names its predictions with them
    config = {"manifest_hash": m.content_hash, "store": str(store), "backbone": backbone,
              "options": jsonable(opts), "run": run_cfg}
    rd.write_json("config.json", config)
    rd.write_csv("metrics.csv", ["round", "seed", "client", "accuracy"], rows)
    rd.save_figure("accuracy_per_round.png", lambda p: plotting.plot_history([result], p))
    rd.save_figure("per_client.png", lambda p: plotting.plot_per_client([result], p))
    rd.save_figure("figure1.png", lambda p: plots.figure1(
        [result], p, title=plotting.title(f"Fine-tuning, {name}", m.source, backbone)))
    md = report.run_markdown(result) + "\n\n" + plots.stages_markdown(result) + \
        "\n![accuracy per round](accuracy_per_round.png)\n![Figure 1](figure1.png)\n![per-client accuracy](per_client.png)\n"
    rd.write_text("summary.md", md)
    return rd.finish(result)  # last: marks the directory complete


def make_algorithm(opts: FinetuneOptions) -> FineTune:
    """FT, or the adapter algorithm `opts.adapter` names."""
    if opts.adapter == "none":
        return FineTune(opts.ft)
    from fedheads.finetuning.adapters import create_adapter_algorithm

    return create_adapter_algorithm(opts.adapter, opts.ft, opts.lora)


def _export_adapted(path: Path, bb: Any, backbone: str, alg: AdapterFT, net: LiveNet, run: FTRun, note: str) -> None:
    """The seed's backbone with the final adapters merged into their layers (W0 + s B A), as a
    `ckpt:` file; `net` is spent (its adapters are folded in)."""
    from embedcache.backbones.ckpt import CkptBackbone, save_backbone_checkpoint

    alg.load(net, run.state.model)
    alg.merge_into(net)
    base = bb.base_name if isinstance(bb, CkptBackbone) else backbone
    save_backbone_checkpoint(path, base, net.staged.to("cpu"), note)


def _export_backbone(path: Path, bb: Any, backbone: str, net: LiveNet, run: FTRun, note: str) -> None:
    """The seed's fine-tuned backbone as a `ckpt:` file: the trained stages from the final global
    model, everything else (the frozen prefix, BatchNorm counters) from the pre-trained backbone,
    so the file depends on the weights only (a resumed run writes the same bytes)."""
    from embedcache.backbones.ckpt import CkptBackbone, save_backbone_checkpoint

    staged = bb.trainable()
    fresh = LiveNet(staged, net.trainable, net.head.out_features, bn=net.bn, live_prefix=net.live_prefix)
    fresh.load_trained_state({**run.state.model.params, **run.state.model.buffers})
    base = bb.base_name if isinstance(bb, CkptBackbone) else backbone  # the file records the root base
    save_backbone_checkpoint(path, base, staged, note)


def _seed_result(run: FTRun, hr: HeadResult, trained_values: int, clients: list, seed: int,
                 opts: FinetuneOptions) -> dict[str, Any]:
    final = next(r for r in reversed(run.rounds) if r.accuracy is not None)
    per_client = {c.name: 100.0 * a for c, a in zip(clients, final.accuracy) if a == a}
    history = [{"round": r.round, "accuracy": 100.0 * nanmean(r.accuracy)} for r in run.rounds if r.accuracy]
    ft = run.rounds[1:]
    up_b, down_b = sum(r.up_bytes for r in ft), sum(r.down_bytes for r in ft)
    hc = hr.communication or {}
    msgs = sum(len(r.participants) for r in ft)
    commsum = {
        "upload_params_per_client_per_round": (sum(r.up_values for r in ft) / msgs) if msgs else 0.0,
        "upload_bytes_total": up_b + int(hc.get("upload_bytes_total", 0)),
        "download_bytes_total": down_b + int(hc.get("download_bytes_total", 0)),
    }
    return {"seed": seed, "per_client": per_client, "history": history, "communication": commsum,
            "trainable_params_per_client": trained_values,
            "clients_without_test": [c.name for c in clients if c.n_test == 0],
            "n_test": {c.name: c.n_test for c in clients}}


def _adapter_block(alg: FineTune, runs: list[FTRun]) -> dict[str, Any] | None:
    """The adapters of a LoRA-family run: algorithm, settings, layers, per-round statistics."""
    if not isinstance(alg, AdapterFT):
        return None
    stats: dict[str, list[list[float]]] = {}
    for run in runs:
        for k in (run.rounds[-1].stats if run.rounds else {}):
            stats.setdefault(k, []).append([r.stats.get(k, float("nan")) for r in run.rounds[1:]])
    return {"algorithm": alg.name, "summary": alg.summary, "trains": list(alg.trains), "shared": list(alg.shared),
            "local_head": alg.local_head, "settings": jsonable(alg.acfg), "privacy": alg.privacy,
            "layers": {n: {"in": layer.in_dim, "out": layer.out_dim} for n, layer in alg.layers.items()},
            "per_round_stats_per_seed": stats}


def _extra(heads: list[HeadResult], runs: list[FTRun], per_seed: list[dict], net: LiveNet, trained_values: int,
           clients: list, trainable: Trainable, opts: FinetuneOptions, head: str, alg: FineTune) -> dict[str, Any]:
    """Stages, FedNCM App. A units, the Figure-1 curves and timing (see the module docstring)."""
    import numpy as np

    C, D = net.head.out_features, net.head.in_features
    K, E = len(clients), opts.ft.local_epochs
    n_all = sum(c.n_train for c in clients)
    P = trained_values - (C * D + C)  # trained base params (adapters: their factors)
    hr = heads[0]
    # FedNCM App. A: Eq. 3 (head tuning) / Eq. 4 (FT) communication, Eq. 5 (FT) / Eq. 6 (head) compute
    if head == "lp":
        head_bytes = comm.comm_lp_bytes(D, C, K, hr.rounds, opts.fraction)
        head_F = comm.comp_lp(hr.rounds, 1, n_all)
    elif head == "random":
        head_bytes, head_F = 0.0, 0
    else:  # a one-pass head: its paper's per-client traffic (FedNCM: Eq. 3, one round), one forward pass
        rc = create_algorithm(head).paper_round_comm(HeadArch((D,), num_classes=C), K)
        head_bytes = float((rc.upload + rc.download) * K * comm.BITS_PER_PARAM / 8) if rc else 0.0
        head_F = comm.comp_fedncm(n_all)
    ft_bytes_per_round = comm.comm_ft_bytes(D, C, P, K, 1, opts.fraction)
    adapters = isinstance(alg, AdapterFT)
    run0 = runs[0]
    by_round: dict[int, list[float]] = {}
    for run in runs:
        for r in run.rounds:
            if r.accuracy:
                by_round.setdefault(r.round, []).append(100.0 * nanmean(r.accuracy))
    hc = hr.communication or {}
    cum_b, cum_F = float(head_bytes), float(head_F)
    meas = float(hc.get("upload_bytes_total", 0) + hc.get("download_bytes_total", 0))
    curve = []
    for r in run0.rounds:
        if r.round > 0:
            # adapters: their papers count the factors actually sent (FFA-LoRA: half of LoRA's upload), so
            # the measured messages of this round; FT: App. A Eq. 4
            cum_b += (r.up_bytes + r.down_bytes) if adapters else ft_bytes_per_round
            cum_F += 3 * E * r.samples  # Eq. 5 with this round's N_s
            meas += r.up_bytes + r.down_bytes
        accs = by_round.get(r.round)
        if accs:
            curve.append({"round": r.round, "accuracy": float(np.mean(accs)),
                          "std": float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0,
                          "paper_comm_bytes": cum_b, "paper_compute_F": cum_F, "measured_comm_bytes": meas})
    stage1_acc = [np.mean(list(h.per_client.values())) for h in heads if h.per_client]
    return {
        "method": method_name(head, opts.adapter), "stage1": head, "adapters": _adapter_block(alg, runs),
        "trainable": trainable.spec, "cut": trainable.cut,
        "bn": net.bn, "server": opts.ft.server, "pretrained": opts.pretrained,
        "clients": [c.name for c in clients], "domains": [c.domain for c in clients],
        "training_rounds": opts.rounds, "fraction": opts.fraction,
        "stages": [
            {"stage": "head", "method": head, "rounds": hr.rounds, "on": "feature store",
             "communication": hr.communication,
             "accuracy": ({"mean": float(np.mean(stage1_acc)),
                           "std": float(np.std(stage1_acc, ddof=1)) if len(stage1_acc) > 1 else 0.0}
                          if stage1_acc else None)},
            {"stage": "finetune", "rounds": opts.rounds, "trainable": trainable.spec, "server": opts.ft.server,
             "inputs": "live images" if net.takes_images else f"cached {trainable.input_backbone('B')} from the store",
             "round0_accuracy_per_seed": [100.0 * nanmean(run.rounds[0].accuracy) for run in runs],
             "seconds_per_round": float(np.mean([r.train_seconds for run in runs for r in run.rounds[1:]] or [0.0])),
             "eval_seconds_per_round": float(np.mean([r.eval_seconds for run in runs for r in run.rounds if r.accuracy]
                                                     or [0.0]))},
        ],
        "paper_units": {
            "reference": "Legate et al. NeurIPS 2023, App. A: Eq. 3 (head tuning) and 4 (FT) in bytes at 32 bit; "
                         "Eq. 5 (FT, 3F per sample) and 6 (head tuning, F per sample) in units of one forward pass F",
            "LL_in": D, "LL_out": C, "P_trained_base_params": P, "clients_K": K,
            "head_comm_bytes": head_bytes, "head_compute_F": head_F,
            "ft_comm_bytes": (float(sum(r.up_bytes + r.down_bytes for r in runs[0].rounds[1:])) if adapters
                              else ft_bytes_per_round * opts.rounds),
            "ft_compute_F": float(3 * E * sum(r.samples for r in run0.rounds[1:])),
            "note": ("adapters: ft_comm_bytes is the bytes measured as sent (the factors and head each round), the "
                     "adapter papers' convention; " if adapters else "") + ("P counts the parameters of the base that "
                     "fine-tuning trains "
                     f"({trainable.spec}); F is one forward pass of the whole model"),
        },
        "figure1": curve,
        "timing": {"per_seed": [seed_timing(s["seed"], run) for s, run in zip(per_seed, runs)],
                   "load_wall_seconds": None, "load_cpu_seconds": None},
    }
