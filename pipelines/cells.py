"""Run one cell (experiment point x method x seed): a pure function of its configuration.

`run_cell` is what dask workers execute (and the serial path calls in-process). It never raises:
a failure comes back as {"status": "failed", "error": one line, "traceback": ...} so that one
bad cell cannot sink a sweep. A finished cell is written atomically to
`<cells dir>/<hash>.json` by the process that ran it (docs/contracts.md, section 9), so results
survive a driver that is killed while workers finish.

Head cells train on the feature store through fedheads' own engine (the path `fedheads train`
takes, one seed); fine-tuning cells call `fedheads.finetuning.runner.finetune_run`; FedDRA cells run the
public `fedheads feddra` command (when this build has it) with the options a user would type.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

RESULT_FORMAT = "pipelines-cell-result/1"
_DATA: OrderedDict[tuple, Any] = OrderedDict()  # per process: the last feature sets loaded
_DATA_SLOTS = 2


def _fed_data(store: str, backbones: tuple[str, ...], device: str, binarize: bool, heap: Any = None) -> Any:
    """The store's FedData, its clients in the store's order (kept for the next cells; `heap`:
    the process's heap policy, fedheads.run.allocator)."""
    from fedheads.run.load import load_fed_data

    key = (store, backbones, device, binarize)
    if key not in _DATA:
        _DATA[key] = load_fed_data(store, list(backbones), device, binarize=binarize)
        if heap is not None:
            heap.after_load()
        while len(_DATA) > _DATA_SLOTS:
            _DATA.popitem(last=False)
    _DATA.move_to_end(key)
    return _DATA[key]


def _settings(cfg: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Method settings scoped to the algorithm (must apply), the others plain (dropped where they
    do not apply), as `fedheads compare --set` treats them."""
    alg = cfg["algorithm"]
    scoped = tuple((f"{alg}.{k}", v) for k, v in cfg["settings"]["method"].items())
    return scoped + tuple(cfg["settings"]["common"].items())


def _paper_units(alg: str, data: Any, rounds: int, fraction: float, cfg: Any) -> dict[str, Any] | None:
    """FedNCM App. A: Eq. 3 / 6 (LP) and FedNCM's single round, for a linear head on D features."""
    from fedheads.report import communication as comm

    D, C, K, N = data.dim, data.num_classes, data.num_clients, int(sum(data.n_train))
    if alg == "fedncm":
        return {"comm_bytes": comm.comm_fedncm_bytes(D, C, K), "compute_F": float(comm.comp_fedncm(N)),
                "per_round": None}
    if alg == "lp":
        E = int(getattr(cfg, "local_epochs", 1) or 1)
        return {"comm_bytes": comm.comm_lp_bytes(D, C, K, rounds, fraction),
                "compute_F": float(comm.comp_lp(rounds, E, N)),
                "per_round": {"comm_bytes": comm.comm_lp_bytes(D, C, K, 1, fraction),
                              "compute_F": float(comm.comp_lp(1, E, N))}}
    return None


def _saved_head(algorithm: str, data: Any, backbones: list[str], opts: Any, out: Path) -> tuple[Path, dict[str, Any]]:
    """`algorithm` trained as `fedheads train --out OUT` trains it (one seed, the cell's options,
    its common settings, its mechanism), for a cell that calibrates a saved head (CCVR's
    head=RUN_DIR). Under DP the head's noise is drawn from another key than the cell's (noise_seed
    + 1): the two releases' noises must be independent for their epsilons to compose."""
    from fedheads.run.train import train_run

    if opts.dp is not None and opts.dp.noise_seed is not None:
        opts = dataclasses.replace(opts, dp=dataclasses.replace(opts.dp, noise_seed=opts.dp.noise_seed + 1))
    res = train_run(None, backbones, algorithm, opts, out, strict=False, data=data, overwrite=True)
    return out, res


def composed_epsilon(blocks: list[dict[str, Any]]) -> float:
    """Epsilon at the blocks' common delta of the releases the privacy `blocks` (results.json's,
    each with noise_multiplier and releases_per_example) made of the same examples, composed as
    dp-accounting composes Gaussian mechanisms (its accountant, RDP or PLD, as the blocks')."""
    import dp_accounting

    from fedheads import privacy_accounting

    deltas, accs = {b["delta"] for b in blocks}, {b["accountant"] for b in blocks}
    if len(deltas) != 1 or len(accs) != 1:
        raise ValueError(f"privacy blocks at different deltas {sorted(deltas)} or accountants {sorted(accs)}")
    zs = {float(b["noise_multiplier"]) for b in blocks}
    releases = sum(int(b["releases_per_example"]) for b in blocks)
    delta, acc = deltas.pop(), accs.pop()
    if len(zs) == 1:  # one Gaussian mechanism released `releases` times
        return privacy_accounting.epsilon(zs.pop(), delta, releases, acc)
    event = dp_accounting.ComposedDpEvent([privacy_accounting.dp_event(b["noise_multiplier"], b["releases_per_example"])
                                           for b in blocks])
    accountant = dp_accounting.rdp.RdpAccountant() if acc == "rdp" else dp_accounting.pld.PLDAccountant()
    return float(accountant.compose(event).get_epsilon(delta))


def run_head(cfg: dict[str, Any], paths: dict[str, Any], heap: Any = None, out: Path | None = None) -> dict[str, Any]:
    """A head cell on the store's features, as `fedheads train` trains one seed (`heap`: the
    process's heap policy, fedheads.run.allocator; None: none). With the option `head_from`, the
    cell first trains that algorithm's head into OUT/head as `fedheads train` would and the cell's
    algorithm calibrates it (head=OUT/head: CCVR); under DP both releases are accounted together."""
    from fedheads.core.engine import run
    from fedheads.privacy import mechanism
    from fedheads.report import results as report
    from fedheads.run.rundir import config_dict
    from fedheads.run.saved import attach_saved_runs
    from fedheads.run.train import TrainOptions, build_algorithm

    o = cfg["options"]
    dp = mechanism(dict(o["dp"])) if o.get("dp") else None  # (field, value) pairs of a privacy.Mechanism
    opts = TrainOptions(rounds=o["rounds"], seeds=(cfg["seed"],), fraction=o["fraction"],
                        engine=o.get("engine", "vectorized"), device=o["device"], eval_every=o["eval_every"],
                        binarize=bool(o.get("binarize", False)), settings=_settings(cfg), progress=False, dp=dp)
    data = _fed_data(paths["store"], tuple(cfg["backbones"]), o["device"], bool(o.get("binarize", False)), heap)
    head: dict[str, Any] | None = None
    if o.get("head_from"):
        if out is None:
            raise ValueError("head_from: the cell has no directory to save the head in")
        head_opts = dataclasses.replace(opts, settings=tuple(cfg["settings"]["common"].items()))
        head_dir, head_res = _saved_head(o["head_from"], data, list(cfg["backbones"]), head_opts, out / "head")
        head = {"algorithm": o["head_from"], "run_dir": str(head_dir),
                "accuracy": (head_res.get("accuracy") or {}).get("mean"), "privacy": head_res.get("privacy")}
        opts = dataclasses.replace(opts, settings=opts.settings + ((f"{cfg['algorithm']}.head", str(head_dir)),))
    alg, used, ignored = build_algorithm(cfg["algorithm"], opts, strict=False)
    attach_saved_runs(alg)  # the saved head (trained from the same arrays: no fingerprints to compare)
    # as fedheads train: the engine may stack the clients in its fastest order (results in the store's)
    res = run(alg, data, opts.rounds, seed=cfg["seed"], fraction=opts.fraction, engine=opts.engine,
              eval_every=opts.eval_every, progress=False, reorder=True,
              between_buckets=None if heap is None else heap.between_buckets)
    names, domains = list(data.client_names), list(data.domains)
    seed_res = report.seed_result_from_run(res, cfg["seed"], names, n_test=data.n_test)
    other = {}
    for rule, acc in res.history[-1].accuracy.items():  # type: ignore[union-attr]
        if rule != "main":
            other[rule] = 100.0 * float(acc[~acc.isnan()].mean())
    privacy = alg.report([alg.releases(res.client_state)]) if dp is not None else None
    extra: dict[str, Any] = {}
    if head is not None:
        extra["saved_head"] = head
        if privacy is not None and head["privacy"] is not None:  # the head's release and this run's, same examples
            extra["privacy_end_to_end"] = {"epsilon": composed_epsilon([head["privacy"], privacy]),
                                           "delta": privacy["delta"], "accountant": privacy["accountant"],
                                           "releases": head["privacy"]["releases_per_example"]
                                           + privacy["releases_per_example"]}
    return {**extra, "seed_result": seed_res, "clients": names, "domains": domains, "privacy": privacy,
            "num_classes": data.num_classes, "feature_dims": [cfg["features"]["backbones"][b]["dim"]
                                                              for b in cfg["backbones"]],
            "training_rounds": opts.rounds - int(getattr(alg, "collect_rounds", 0)), "other_rules": other,
            "algorithm_kwargs": used, "ignored_options": ignored,
            "algorithm_config": config_dict(getattr(alg, "cfg", None)),
            "paper_units": _paper_units(cfg["algorithm"], data, opts.rounds, opts.fraction, getattr(alg, "cfg", None))}


def _finetune_options(cfg: dict[str, Any], paths: dict[str, Any]) -> Any:
    """FinetuneOptions of a cell: its settings are `fedheads finetune --set` keys (`ft.KEY` names
    the same key); method settings must apply, common ones apply where they are a key."""
    from fedheads.finetuning.runner import SETTINGS, finetune_options

    keys = {f.name for part in SETTINGS for f in part.fields()}
    o = cfg["options"]
    run = {"fraction": o["fraction"]}
    items: list[tuple[str, Any]] = []
    for scope in ("common", "method"):  # method settings last: they win, and they must apply
        for k, v in cfg["settings"][scope].items():
            key = k[3:] if k.startswith("ft.") else k
            if key in keys:
                items.append((key, v))
            elif key in run:
                run[key] = v
            elif scope == "method":
                raise ValueError(f"setting {k!r}: not a setting of fedheads finetune (fedheads.finetuning.runner.SETTINGS)")
    return finetune_options(items, heads=(cfg["algorithm"],), rounds=o["rounds"], seeds=(cfg["seed"],),
                            eval_every=o["eval_every"], device=o["device"], num_workers=0,
                            weights_dir=paths.get("weights_dir"), resume=True, progress=False, **run)


def run_finetune(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> dict[str, Any]:
    """`fedheads finetune` for one stage-1 head and seed; resumes a killed cell from its checkpoint."""
    from fedheads.finetuning.runner import finetune_run

    opts = _finetune_options(cfg, paths)
    res = finetune_run(paths["manifest"], paths["store"], cfg["backbones"][0], out, opts)
    return {"seed_result": _seed_result_from_results(res, cfg["seed"]), "clients": res.get("clients", []),
            "domains": res.get("domains", []), "figure1": res.get("figure1"), "paper_units": res.get("paper_units"),
            "stages": res.get("stages"), "run_dir": str(out)}


def _seed_result_from_results(res: dict[str, Any], seed: int) -> dict[str, Any]:
    """A one-seed results.json (contract 6) as a per-seed entry of fedheads.report.results.summarise_runs."""
    per_client = {c: v["mean"] for c, v in res["per_client"].items() if v.get("mean") is not None}
    comm = {k: res.get("communication", {}).get(k) for k in
            ("upload_params_per_client_per_round", "upload_bytes_total", "download_bytes_total")}
    return {"seed": seed, "per_client": per_client, "history": [{"round": h["round"], "accuracy": h["accuracy"]}
                                                                  for h in res.get("history", [])],
            "communication": comm if all(v is not None for v in comm.values()) else None,
            "trainable_params_per_client": res.get("trainable_params_per_client"),
            "clients_without_test": res.get("clients_without_test", []),
            "n_test": {c: v.get("n_test", 0) for c, v in res["per_client"].items()}}


FEDDRA_COMMAND = "fedheads feddra"
FEDDRA_MISSING = "fedheads feddra not available in this build"


def feddra_available() -> bool:
    """Whether this build's `fedheads` command line has the `feddra` command."""
    try:
        from fedheads.cli import main
    except ImportError:
        return False
    return "feddra" in getattr(main, "commands", {})


def feddra_args(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> list[str]:
    """The `fedheads feddra` command line of one cell, as a user would type it: the preset is its
    --baseline and every setting a --set (("rho", 0.1) -> --set rho=0.1)."""
    o = cfg["options"]
    image, text = cfg["backbones"][:2]
    args = ["feddra", "--manifest", str(paths["manifest"]), "--image-encoder", image, "--text-encoder", text,
            "--baseline", cfg["algorithm"], "--rounds", str(o["rounds"]), "--seeds", str(cfg["seed"]),
            "--eval-every", str(o["eval_every"]), "--device", o["device"], "--num-workers", "0", "--quiet",
            "--out", str(out)]
    if paths.get("weights_dir"):
        args += ["--weights-dir", str(paths["weights_dir"])]
    if out.exists():
        args.append("--resume")  # a killed cell continues from its last per-round checkpoint
    for k, v in {**cfg["settings"]["common"], **cfg["settings"]["method"]}.items():
        args += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return args


def run_feddra(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> dict[str, Any]:
    """One preset and seed through the public `fedheads feddra` command (in this process: no second
    torch start-up per cell); its results.json becomes the cell's result."""
    if not feddra_available():
        raise RuntimeError(FEDDRA_MISSING)
    from fedheads.cli import main

    args = feddra_args(cfg, paths, out)
    main.main(args=args, prog_name="fedheads", standalone_mode=False)
    res = json.loads((out / "results.json").read_text())
    return {"seed_result": _seed_result_from_results(res, cfg["seed"]), "clients": res.get("clients", []),
            "domains": res.get("domains", []), "retrieval": res.get("retrieval"), "run_dir": str(out),
            "command": " ".join(["fedheads", *args])}


def result_path(cells_dir: str | Path, h: str) -> Path:
    return Path(cells_dir) / f"{h}.json"


def run_cell(cell: dict[str, Any], cells_dir: str, heap: Any = None) -> dict[str, Any]:
    """Run `cell` and write its result file; returns the record (status "done" or "failed").
    `heap`: the process's heap policy (fedheads.run.allocator.GlibcHeap); None: the one its environment
    chose at spawn (a sweep worker's: fedheads.run.allocator.from_environment), if any."""
    import torch

    from embedcache.atomic import atomic_path
    from fedheads.run import allocator as heap_mod

    heap = heap if heap is not None else heap_mod.from_environment()

    cfg, paths = cell["config"], cell["paths"]
    t0, c0 = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    record: dict[str, Any] = {"format": RESULT_FORMAT, "hash": cell["hash"], "config": cfg, "labels": cell["labels"]}
    try:
        torch.set_num_threads(int(cfg.get("threads", 1)))
        out = Path(cells_dir) / cell["hash"]
        if cfg["kind"] == "head":
            result = run_head(cfg, paths, heap, out)
        elif cfg["kind"] == "finetune":
            result = run_finetune(cfg, paths, out / "run")
        else:
            result = run_feddra(cfg, paths, out / "run")
        record.update(status="done", result=result)
    except BaseException as exc:  # noqa: BLE001 - a cell's failure is data, never the sweep's end
        if isinstance(exc, KeyboardInterrupt):
            raise
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                      traceback=traceback.format_exc()[-4000:])
    finally:
        torch.set_num_threads(threads)
        if heap is not None:  # what the cell freed goes back to the OS (kept for reuse while it ran)
            heap_mod.release_free_heap()
    record["timing"] = {"wall_seconds": round(time.perf_counter() - t0, 4),
                        "cpu_seconds": round(time.process_time() - c0, 4),
                        "host": socket.gethostname(), "pid": os.getpid(), "finished": time.time()}
    name = result_path(cells_dir, cell["hash"] if record["status"] == "done" else f"{cell['hash']}.failed")
    with atomic_path(name) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
    if record["status"] == "done":
        result_path(cells_dir, f"{cell['hash']}.failed").unlink(missing_ok=True)
    return record
