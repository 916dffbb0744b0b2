"""Run one cell (experiment point x method x seed): a pure function of its configuration.

`run_cell` is what dask workers execute (and the serial path calls in-process). It never raises:
a failure comes back as {"status": "failed", "error": one line, "traceback": ...} so that one
bad cell cannot sink a sweep. A finished cell is written atomically to
`<cells dir>/<hash>.json` by the process that ran it (docs/contracts.md, section 9), so results
survive a driver that is killed while workers finish.

Every cell trains through fedheads' public API with the options a user would give it: head
cells `fedheads.train` (one seed, in memory, on the store's features held by `fedheads.load`),
fine-tuning cells `fedheads.finetune`, FedDRA cells `fedheads.feddra`.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fedheads

RESULT_FORMAT = "pipelines-cell-result/1"
_DATA: OrderedDict[tuple, Any] = OrderedDict()  # per process: the last feature sets loaded
_DATA_SLOTS = 2


def _fed_data(store: str, backbones: tuple[str, ...], device: str, binarize: bool, heap: Any = None) -> Any:
    """The store's features in memory, its clients in the store's order (kept for the next cells;
    `heap`: the process's heap policy, fedheads.run.allocator)."""
    key = (store, backbones, device, binarize)
    if key not in _DATA:
        _DATA[key] = fedheads.load(store, backbones, device=device, binarize=binarize)
        if heap is not None:
            heap.after_load()
        while len(_DATA) > _DATA_SLOTS:
            _DATA.popitem(last=False)
    _DATA.move_to_end(key)
    return _DATA[key]


def _settings(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the method's settings scoped to the algorithm, which must apply, and the common ones that
    are its settings; the common keys that are not, dropped and recorded as `fedheads compare` does)."""
    alg = cfg["algorithm"]
    keys = fedheads.settings(alg)
    common = cfg["settings"]["common"]
    used = {**{k: v for k, v in common.items() if k in keys}, **{f"{alg}.{k}": v for k, v in cfg["settings"]["method"].items()}}
    return used, [k for k in common if k not in keys]


def _takes(fn: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The cell's options that the API function `fn` takes (by their names: rounds, device, ...)."""
    import inspect

    takes = inspect.signature(fn).parameters
    return {k: v for k, v in options.items() if k in takes}


def _paper_units(alg: str, data: Any, rounds: int, fraction: float, cfg: Any) -> dict[str, Any] | None:
    """FedNCM App. A: Eq. 3 / 6 (LP) and FedNCM's single round, for a linear head on D features."""
    from fedheads.report import communication as comm

    D, C, K, N = data.dim, data.num_classes, data.num_clients, int(sum(data.n_train))
    if alg == "fedncm":
        return {"comm_bytes": comm.comm_fedncm_bytes(D, C, K), "compute_F": float(comm.comp_fedncm(N)),
                "per_round": None}
    if alg == "lp":
        E = int(cfg.get("local_epochs", 1) or 1)
        return {"comm_bytes": comm.comm_lp_bytes(D, C, K, rounds, fraction),
                "compute_F": float(comm.comp_lp(rounds, E, N)),
                "per_round": {"comm_bytes": comm.comm_lp_bytes(D, C, K, 1, fraction),
                              "compute_F": float(comm.comp_lp(1, E, N))}}
    return None


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
    """A head cell on the store's features, as `fedheads train` trains one seed, every round run
    (`all_rounds`: the per-round history cells record; `heap`: the process's heap policy,
    fedheads.run.allocator; None: none). With the option `head_from`, the cell first trains that
    algorithm's head into OUT/head as `fedheads train` would and the cell's algorithm calibrates
    it (head=OUT/head: CCVR); under DP both releases are accounted together (the head's noise drawn
    from another key, noise_seed + 1: the two noises must be independent for their epsilons to compose)."""
    o = cfg["options"]
    dp = dict(o["dp"]) if o.get("dp") else None  # (field, value) pairs of a privacy.Mechanism
    data = _fed_data(paths["store"], tuple(cfg["backbones"]), o["device"], bool(o.get("binarize", False)), heap)
    run = {"backbones": cfg["backbones"], "seeds": cfg["seed"], **_takes(fedheads.train, o), "all_rounds": True}
    settings, ignored = _settings(cfg)
    head: dict[str, Any] | None = None
    if o.get("head_from"):
        if out is None:
            raise ValueError("head_from: the cell has no directory to save the head in")
        head_dp = dp if dp is None or dp.get("noise_seed") is None else {**dp, "noise_seed": dp["noise_seed"] + 1}
        common = {k: v for k, v in cfg["settings"]["common"].items() if k in fedheads.settings(o["head_from"])}
        head_res = fedheads.train(data, o["head_from"], **{**run, "all_rounds": False}, settings=common, dp=head_dp,
                                  out=out / "head", overwrite=True)
        head = {"algorithm": o["head_from"], "run_dir": str(out / "head"),
                "accuracy": (head_res.get("accuracy") or {}).get("mean"), "privacy": head_res.get("privacy")}
        settings[f"{cfg['algorithm']}.head"] = str(out / "head")
    res = fedheads.train(data, cfg["algorithm"], **run, settings=settings, dp=dp)
    privacy = res.get("privacy")
    extra: dict[str, Any] = {}
    if head is not None:
        extra["saved_head"] = head
        if privacy is not None and head["privacy"] is not None:  # the head's release and this run's, same examples
            extra["privacy_end_to_end"] = {"epsilon": composed_epsilon([head["privacy"], privacy]),
                                           "delta": privacy["delta"], "accountant": privacy["accountant"],
                                           "releases": head["privacy"]["releases_per_example"]
                                           + privacy["releases_per_example"]}
    return {**extra, "seed_result": res.per_seed[0], "clients": res["clients"], "domains": res["domains"],
            "privacy": privacy, "num_classes": res["num_classes"],
            "feature_dims": [cfg["features"]["backbones"][b]["dim"] for b in cfg["backbones"]],
            "training_rounds": res["training_rounds"],
            "other_rules": {rule: v["values"][0] for rule, v in res["other_rules"].items()},
            "algorithm_kwargs": res.config["algorithm_kwargs"], "ignored_options": ignored,
            "algorithm_config": res.config["algorithm_config"],
            "paper_units": _paper_units(cfg["algorithm"], data, o["rounds"], o["fraction"],
                                        res.config["algorithm_config"] or {})}


def _method_settings(cfg: dict[str, Any], command: str, run: dict[str, Any]) -> dict[str, Any]:
    """The settings of a fine-tuning or FedDRA cell: `fedheads finetune / feddra --set` keys (`ft.KEY`
    names the same key); method settings must apply, common ones apply where they are a key or a
    run option (`run`, updated)."""
    keys = fedheads.settings(command)
    items: dict[str, Any] = {}
    for scope in ("common", "method"):  # method settings last: they win, and they must apply
        for k, v in cfg["settings"][scope].items():
            key = k[3:] if k.startswith("ft.") else k
            if key in keys:
                items[key] = v
            elif key in run:
                run[key] = v
            elif scope == "method":
                raise ValueError(f"setting {k!r}: not a setting of fedheads {command}")
    return items


def run_finetune(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> dict[str, Any]:
    """`fedheads finetune` for one stage-1 head and seed; resumes a killed cell from its checkpoint."""
    o = cfg["options"]
    run = {"fraction": o["fraction"]}
    settings = _method_settings(cfg, "finetune", run)
    res = fedheads.finetune(paths["manifest"], paths["store"], cfg["backbones"][0], out,
                            **{**_takes(fedheads.finetune, o), **run}, heads=(cfg["algorithm"],), seeds=(cfg["seed"],),
                            num_workers=0, weights_dir=paths.get("weights_dir"), resume=True, settings=settings)
    return {"seed_result": _seed_result_from_results(res, cfg["seed"]), "clients": res.get("clients", []),
            "domains": res.get("domains", []), "figure1": res.get("figure1"), "paper_units": res.get("paper_units"),
            "stages": res.get("stages"), "run_dir": str(out)}


def _seed_result_from_results(res: Any, seed: int) -> dict[str, Any]:
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


FEDDRA_MISSING = "fedheads feddra not available in this build"


def feddra_available() -> bool:
    """Whether this build's public API has `fedheads.feddra`."""
    return callable(getattr(fedheads, "feddra", None))


def feddra_keywords(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> dict[str, Any]:
    """The `fedheads.feddra` keywords of one cell, as a user would give them: the preset is its
    baseline and every setting one of `settings`."""
    return {**_takes(fedheads.feddra, cfg["options"]), "baselines": (cfg["algorithm"],), "seeds": (cfg["seed"],),
            "num_workers": 0,
            "weights_dir": paths.get("weights_dir") or None, "resume": out.exists(),  # a killed cell continues
            "settings": {**cfg["settings"]["common"], **cfg["settings"]["method"]}}


def feddra_command(cfg: dict[str, Any], paths: dict[str, Any], out: Path, kw: dict[str, Any]) -> str:
    """The `fedheads feddra` command line the cell's call stands for (recorded with its result)."""
    image, text = cfg["backbones"][:2]
    args = ["fedheads", "feddra", "--manifest", str(paths["manifest"]), "--image-encoder", image, "--text-encoder", text,
            "--baseline", cfg["algorithm"], "--seeds", str(cfg["seed"]), "--num-workers", "0", "--quiet", "--out", str(out)]
    args += [x for k, v in _takes(fedheads.feddra, cfg["options"]).items() for x in (f"--{k.replace('_', '-')}", str(v))]
    args += ["--weights-dir", str(kw["weights_dir"])] if kw["weights_dir"] else []
    args += ["--resume"] if kw["resume"] else []
    for k, v in kw["settings"].items():
        args += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return " ".join(args)


def run_feddra(cfg: dict[str, Any], paths: dict[str, Any], out: Path) -> dict[str, Any]:
    """One preset and seed through `fedheads.feddra` (in this process: no second torch start-up per
    cell); its results.json becomes the cell's result."""
    if not feddra_available():
        raise RuntimeError(FEDDRA_MISSING)
    image, text = cfg["backbones"][:2]
    kw = feddra_keywords(cfg, paths, out)
    command = feddra_command(cfg, paths, out, kw)
    res = fedheads.feddra(paths["manifest"], image, text, out, **kw)
    return {"seed_result": _seed_result_from_results(res, cfg["seed"]), "clients": res.get("clients", []),
            "domains": res.get("domains", []), "retrieval": res.get("retrieval"), "run_dir": str(out),
            "command": command}


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
