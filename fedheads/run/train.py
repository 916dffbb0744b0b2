"""Run directories: train one algorithm over several seeds, or compare several, and write the
artefacts a person or a script reads afterwards.

    RUN_DIR/results.json        the results contract (fedheads.report.results.summarise_runs)
    RUN_DIR/config.json         the whole resolved configuration (algorithm config per seed too)
    RUN_DIR/metrics.csv         per round x seed x client x rule accuracy (percent)
    RUN_DIR/summary.md          a short human report, with the plots below
    RUN_DIR/accuracy_per_round.png, RUN_DIR/per_client.png
    RUN_DIR/state/seed<S>.pt    final client + server state (tensors only: torch.load(weights_only=True);
                                sealed with a digest checked on load, fedheads.run.checkpoint)

`fedheads predict` rebuilds the algorithm from config.json, loads a state file and classifies
features by nearest prototype with faiss (fedheads.prediction.prototypes)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from embedcache.errors import UserError
from fedheads.core.engine import RunResult, clock, run, to_device
from fedheads.core.federation import FedData, Federation, layout_info
from fedheads.report import plotting
from fedheads.report import results as report
from fedheads.run import checkpoint, rundir
from fedheads.run.allocator import GlibcHeap
from fedheads.run.checks import check_trained_state
from fedheads.run.commands import Compare, Train, TrainOptions
from fedheads.run.environment import machine
from fedheads.run.load import load_fed_data, resolve_device
from fedheads.run.options import dump, file_config
from fedheads.run.progress import RoundBar
from fedheads.run.rundir import RunDir, config_dict
from fedheads.run.saved import attach_saved_runs, state_blob
from fedheads.run.settings import build_algorithm, resolve_settings, resolved_settings, unknown_key_error
from fedheads.version import __version__

if TYPE_CHECKING:
    from embedcache.store.reader import StoreInfo

def store_fingerprint(info: Any, backbones: Sequence[str]) -> dict[str, Any]:
    """What must match between the training store and a prediction store: the class list and,
    per backbone, its feature dimension, weights sha256 and preprocessing (shard attributes);
    also how it was extracted (batch size, chunk rows, dtype), so that `predict` extracts new
    images the same way (docs/contracts.md, 6)."""
    from embedcache.store.reader import shard_attributes, shard_chunk_rows

    out: dict[str, Any] = {"classes": list(info.classes), "backbones": {}}
    for b in backbones:
        sh = next((s for s in info.shards if s.backbone == b), None)
        if sh is None:
            raise UserError(f"backbone {b!r}: not in store {info.path} (has: {', '.join(info.backbones)})")
        a = shard_attributes(info, sh)
        chunk_rows = shard_chunk_rows(info, sh)  # from its metadata: opening the zarr hierarchy took seconds at 1,000s of shards
        out["backbones"][b] = {"dim": sh.dim, "weights_sha256": a.get("weights_sha256"),
                               "preprocess": a.get("preprocess"), "batch_size": a.get("batch_size", 64),
                               "chunk_rows": chunk_rows, "dtype": sh.dtype}
    return out


def backbone_dims(info: Any, backbones: Sequence[str]) -> list[int]:
    """Feature dimension of each backbone, in order (from the shards' attributes)."""
    dims = []
    for b in backbones:
        ds = {s.dim for s in info.shards if s.backbone == b}
        if not ds:
            raise UserError(f"backbone {b!r}: not in store {info.path} (has: {', '.join(info.backbones)})")
        dims.append(ds.pop())
    return dims


def environment() -> dict[str, Any]:
    return {"fedheads": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _since(t0: tuple[float, float], device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds since `t0` (after the device's queued work)."""
    t = clock(device)
    return t[0] - t0[0], t[1] - t0[1]


@dataclass(frozen=True)
class StoreRecord:
    """What a run records about the store it trained on, read when the run opens it (once)."""

    path: str  # the store directory (config.json `store`)
    dataset: str  # what the features are of (results.json `dataset`: dataset_name)
    fingerprint: dict[str, Any]  # config.json `store_fingerprint` (store_fingerprint)
    dims: tuple[int, ...]  # feature dimension per backbone, in order

    @staticmethod
    def of(info: StoreInfo, backbones: Sequence[str]) -> StoreRecord:
        """The record of an opened store (embedcache.store.reader.open_store) for `backbones`."""
        return StoreRecord(str(info.path), dataset_name(info), store_fingerprint(info, backbones),
                           tuple(backbone_dims(info, backbones)))


def open_run_store(store: str | Path | StoreInfo, backbones: Sequence[str]) -> tuple[StoreInfo, StoreRecord]:
    """The store a run reads (opened here when given as a path: the one open of a run) and its
    record."""
    from embedcache.store.reader import StoreInfo, open_store

    info = store if isinstance(store, StoreInfo) else open_store(store)
    return info, StoreRecord.of(info, backbones)


def _store_record(store: str | Path | StoreRecord | None, backbones: Sequence[str]) -> StoreRecord | None:
    """`store` as a StoreRecord (a path is opened for it; None: features given as arrays)."""
    if store is None or isinstance(store, StoreRecord):
        return store
    return open_run_store(store, backbones)[1]


def load_store(store: str | Path | StoreInfo, backbones: Sequence[str], opts: TrainOptions,
               heap: GlibcHeap | None = None, recorded: str | None = None) -> tuple[Federation, StoreRecord]:
    """The store's features in `opts.layout` (clients in the store's order) and its record, from
    one open of the store. `heap`: the process's heap policy (fedheads.run.allocator), None for none.
    `recorded`: the layout a resumed run's checkpoints name (checkpoint.recorded_layout), which
    `auto` keeps instead of choosing again."""
    info, record = open_run_store(store, backbones)
    layout, may_stream = opts.layout, opts.engine == "vectorized"
    if opts.layout == "auto" and recorded is not None:
        layout, may_stream = ("streamed", True) if recorded == "streamed" else ("auto", False)
    data = load_fed_data(info, backbones, resolve_device(opts.device), binarize=opts.binarize, layout=layout,
                         may_stream=may_stream)
    if data.layout != "streamed":  # a streamed run reads its buckets as it goes
        info.release_root()  # everything the run reads from the store is read: its metadata need not stay
    del info
    if heap is not None:
        heap.after_load()
    return data, record


def _features(store: str | Path | StoreInfo | None, data: Federation | None, backbones: Sequence[str],
              opts: TrainOptions, t_start: tuple[float, float], what: str, heap: GlibcHeap | None,
              resumed: Path | None = None) -> tuple[Federation, StoreRecord | None, tuple[float, float] | None]:
    """(the features a run trains on, its store's record, the (wall, CPU) seconds their load took
    since t_start: None when `data` was given), from one open of `store`. `resumed`: the run
    directory a --resume continues (its checkpoints' layout is kept under `auto`)."""
    if data is not None:
        record = None if store is None else open_run_store(store, backbones)[1]
        return data, record, None
    if store is None:
        raise UserError(f"{what}: needs a store or the features as data")
    recorded = None if resumed is None or opts.layout != "auto" else checkpoint.recorded_layout(resumed)
    data, record = load_store(store, backbones, opts, heap, recorded)
    return data, record, _since(t_start, data.device)


def _training(heap: GlibcHeap | None, data: Federation) -> contextlib.AbstractContextManager[None]:
    """The block `data`'s rounds train inside under `heap` (fedheads.run.allocator.GlibcHeap.training)."""
    return contextlib.nullcontext() if heap is None else heap.training(isinstance(data, FedData))


def _attach(alg: Any, record: StoreRecord | None) -> None:
    """The runs `alg`'s settings read (CCVR's head=RUN_DIR), opened and handed to it: of other
    classes or features than `record`'s, refused before training (fedheads.run.saved)."""
    fp = None if record is None else record.fingerprint
    attach_saved_runs(alg, None if fp is None else fp["classes"], None if fp is None else fp["backbones"])


def require_test_samples(data: Federation) -> None:
    """Accuracy needs test samples somewhere: stop before training when no client has any."""
    if not any(data.n_test):
        raise UserError(f"no client has test samples (e.g. {data.client_names[0]}: 0); re-partition with "
                        "fewer --train-per-class or --test-per-class > 0")


@dataclass
class TrainedRun:
    """One algorithm trained over every seed, in memory: what `train_run` writes to a run
    directory (results.json's dict, config.json's dict, metrics.csv's rows, each seed's state)."""

    result: dict[str, Any]
    config: dict[str, Any]
    rows: list[list[Any]]
    states: dict[int, RunResult] = field(default_factory=dict)  # seed -> final states (cpu)
    opts: TrainOptions | None = None  # what it was trained with (config.yaml)
    per_seed: list[dict[str, Any]] = field(default_factory=list)  # each seed's entry (report.seed_result_from_run)


def dataset_name(info: StoreInfo) -> str:
    """What the features of an opened store are of, for titles (results.json `dataset`): the
    store's manifest source, else the store directory's name."""
    return info.source or Path(info.path).name


def rounds_needed(algorithm: Any, opts: TrainOptions, all_rounds: bool = False) -> int:
    """The rounds `algorithm` trains: `opts.rounds`, except a one-pass algorithm
    (AlgorithmBase.one_pass: FedNCM Alg. 1, Fed3R, FedCOF) with every client in every round, whose later
    rounds would only send zeros and re-evaluate the same model: one round (results.json keeps
    `rounds` as asked, `training_rounds` says what ran), unless `all_rounds`. `algorithm`: a name, or
    the run's built one."""
    if opts.fraction >= 1.0 and report.one_pass(algorithm) and not all_rounds:
        return min(opts.rounds, 1)
    return opts.rounds


def train_data(data: Federation, backbones: Sequence[str], algorithm: str, opts: TrainOptions, *,
               store: str | Path | StoreRecord | None = None, strict: bool = True,
               t_start: tuple[float, float] | None = None,
               load: tuple[float, float] | None = None, state_dir: Path | None = None,
               resume: bool = False, heap: GlibcHeap | None = None,
               built: tuple[Any, dict[str, Any], list[str]] | None = None, all_rounds: bool = False) -> TrainedRun:
    """Train `algorithm` once per seed on `data` and build the run's artefacts, every per-client
    result, saved state and row in `data`'s client order (`built`: what build_algorithm returned
    for it, else it is built here; one algorithm object runs every seed). `store`: where the features came from
    (its record, or its path, opened here once; recorded with its fingerprint and feature
    dimensions in the config; None: one block of data.dim). With `state_dir`, each seed writes a
    checkpoint there after every round (fedheads.run.checkpoint) and, with `resume`, continues from it;
    without, nothing is written. `heap`: the process's heap policy (fedheads.run.allocator; None: none)."""
    if t_start is None:
        t_start = clock(torch.device("cpu"))
    alg, used, ignored = built or build_algorithm(algorithm, opts, strict=strict)  # bad options fail before training
    alg_cfg = config_dict(getattr(alg, "cfg", None))
    require_test_samples(data)
    record = _store_record(store, backbones)
    _attach(alg, record)
    names, n_test = list(data.client_names), list(data.n_test)
    dims = [data.dim] if record is None else list(record.dims)
    per_seed, rows = [], []
    states: dict[int, RunResult] = {}
    extra_rules: dict[str, list[float]] = {}
    data_id = None
    if state_dir is not None:
        data_id = checkpoint.data_settings(data)
    rounds = rounds_needed(alg, opts, all_rounds)
    releases: list[int] = []  # per seed, under DP: the most rounds one client's statistics were released in
    classes = list(record.fingerprint["classes"]) if record is not None else [str(c) for c in range(data.num_classes)]
    notes: list[str] = []  # AlgorithmBase.trained_notes, once each over the seeds
    seeds = list(opts.seeds)
    if len(seeds) > 1 and alg.seed_free and opts.fraction >= 1.0 and opts.dp is None:
        notes.append(f"{alg.name} does not depend on the seed with every client in every round: ran once "
                     f"(seed {seeds[0]}) for the {len(seeds)} seeds asked")
        print(f"note: {notes[-1]}", file=sys.stderr, flush=True)
        seeds = seeds[:1]
    for seed in seeds:
        ck, log = None, None
        if state_dir is not None and opts.tensorboard:
            from fedheads.run.tracking import RoundLogger

            log = RoundLogger(state_dir.parent / "tensorboard", seed, algorithm)
        if state_dir is not None:
            # --set / --lr ... are in the algorithm's config: the diff then names the field once
            settings = {"algorithm": algorithm, "algorithm_config": alg_cfg, "seed": seed,
                        "options": {k: v for k, v in config_dict(opts).items()
                                    if k not in ("progress", "tensorboard", "settings", *opts.generic_names)},
                        "device": str(data.device), "layout": layout_info(data),
                        "store": None if record is None else record.path,
                        "backbones": list(backbones), "data": data_id}
            ck = checkpoint.HeadCheckpoint(state_dir / f"seed{seed}.ckpt.pt", settings, algorithm, resume, log,
                                           alg.server_sized_fields)
        try:
            with _training(heap, data), RoundBar(f"{alg.name}[{opts.engine}]", opts.progress) as bar:
                res = run(alg, data, rounds, seed=seed, fraction=opts.fraction, engine=opts.engine,
                          eval_every=opts.eval_every, progress=bar, checkpoint=ck, reorder=True,
                          between_buckets=None if heap is None else heap.between_buckets)
            check_trained_state({"client": res.client_state, "server": res.server_state}, algorithm, seed)
            for line in alg.trained_notes(res.server_state, classes):  # or refuses a state that learned nothing
                if line not in notes:
                    notes.append(line)
                    print(f"note: {line}", file=sys.stderr, flush=True)
        finally:
            if log is not None:
                log.close()
        per_seed.append(report.seed_result_from_run(res, seed, names, n_test=n_test))
        for rule, acc in res.history[-1].accuracy.items():  # type: ignore[union-attr]
            if rule != "main":
                extra_rules.setdefault(rule, []).append(100.0 * float(acc[~acc.isnan()].mean()))
        rows += report.metrics_rows(res, seed, names)
        if opts.dp is not None:
            from fedheads.privacy import plain_client_state

            releases.append(alg.releases(res.client_state))
            res.client_state = plain_client_state(res.client_state)  # what `fedheads predict` rebuilds
        states[seed] = RunResult(res.algorithm, res.engine, client_state=to_device(res.client_state, "cpu"),
                                 server_state=to_device(res.server_state, "cpu"))
    extra = {"dataset": None if record is None else record.dataset,
             "training_rounds": rounds - int(getattr(alg, "collect_rounds", 0)),
             "one_pass": bool(alg.one_pass),
             "clients": names, "domains": list(data.domains),
             "num_classes": data.num_classes, "feature_dim": data.dim, "engine": opts.engine,
             "layout": layout_info(data),
             "fraction": opts.fraction,
             "other_rules": {k: {"mean": float(torch.tensor(v).mean()), "values": v}
                             for k, v in extra_rules.items()}}
    if notes:
        extra["notes"] = notes
    if opts.dp is not None:
        extra["privacy"] = alg.report(releases)
    if "global_model" in extra_rules:
        extra["global_model_accuracy"] = extra["other_rules"]["global_model"]
    extra["timing"] = report.timing_block(per_seed, *_since(t_start, data.device), machine(data.device), load)
    result = report.summarise_runs(per_seed, algorithm=algorithm, backbones=list(backbones),
                                   rounds=opts.rounds, feature_dims=dims, num_classes=data.num_classes,
                                   fraction=opts.fraction, extra=extra, built=alg)
    config: dict[str, Any] = {"store": None if record is None else record.path, "backbones": list(backbones),
                              "algorithm": algorithm}
    if record is not None:
        config["store_fingerprint"] = record.fingerprint
    config.update({"options": config_dict(opts), "algorithm_kwargs": used if per_seed else {},
                   "algorithm_config": alg_cfg, "ignored_options": ignored, "environment": environment()})
    return TrainedRun(result, config, rows, states, opts, per_seed)


@rundir.holds_lock
def train_run(store: str | Path | StoreInfo | None, backbones: Sequence[str], algorithm: str, opts: TrainOptions,
              out: str | Path, strict: bool = True, data: Federation | None = None,
              overwrite: bool = False, resume: bool = False, heap: GlibcHeap | None = None,
              all_rounds: bool = False) -> dict[str, Any]:
    """Train `algorithm` once per seed, write the run directory, return results.json's dict.
    An --out holding a run is refused unless `overwrite` (fedheads.run.rundir). `store`: a path, or
    the store the caller opened (embedcache.store.reader.open_store: not opened again); it is opened at
    most once per run. Features are loaded in `opts.layout`; a `data` given runs in the layout it
    has (results.json "layout" says which). `store` may be None when `data` is given (features
    from numpy arrays: no store fingerprint in config.json). Every round is checkpointed in
    RUN_DIR/state/; `resume` continues from there (fedheads.run.checkpoint). `heap`: the process's heap
    policy (fedheads.run.allocator.GlibcHeap, which the `fedheads` command chooses; None: none)."""
    rd = RunDir(out)
    rd.check(overwrite, resume)
    built = build_algorithm(algorithm, opts, strict=strict)  # bad options fail before the old run is touched
    if opts.tensorboard:
        from fedheads.run.tracking import require

        require()
    t_start = clock(torch.device("cpu"))  # nothing queued on a device yet
    data, record, load = _features(store, data, backbones, opts, t_start, "train", heap, rd.path if resume else None)
    require_test_samples(data)
    _attach(built[0], record)  # a saved run it reads is refused before the run directory is touched
    rd.begin(overwrite)  # results.json marks a complete run: no old file may sit beside the new ones
    trained = train_data(data, backbones, algorithm, opts, store=record, strict=strict, t_start=t_start, load=load,
                         state_dir=rd.path / "state", resume=resume, heap=heap, built=built, all_rounds=all_rounds)
    write_trained(rd, trained)
    return trained.result


def write_trained(out: str | Path | RunDir, trained: TrainedRun) -> None:
    """A run directory (docs/contracts.md, 6) from a run trained in memory."""
    rd = out if isinstance(out, RunDir) else RunDir(out)
    for seed, states in trained.states.items():
        rd.save_state(f"state/seed{seed}.pt", state_blob(states))
    if trained.opts is not None:
        c = trained.config
        write_config_yaml(rd, "train", c["store"], c["backbones"], [c["algorithm"]], trained.opts,
                          dropped=tuple(c.get("ignored_options", ())),
                          configs={c["algorithm"]: c.get("algorithm_config")})
    write_run_files(rd, trained.result, trained.config, trained.rows)


def write_config_yaml(rd: RunDir, command: str, store: str | None, backbones: Sequence[str],
                      algorithms: Sequence[str], opts: TrainOptions, dropped: tuple[str, ...] = (),
                      configs: dict[str, Any] | None = None) -> None:
    """RUN_DIR/config.yaml: the effective configuration, as `--dump-config` prints it (`fedheads
    <command> --config RUN_DIR/config.yaml` runs it again). `dropped`: generic options that did not
    apply to the algorithm (a member of a comparison: left out); `configs`: {algorithm: the config
    it trained with} (then nothing is built again)."""
    opts = dataclasses.replace(opts, **{k: None for k in dropped if k in opts.generic_names})
    cmd: Train | Compare = Train(store, tuple(backbones), algorithms[0], opts, out=str(rd.path)) if command == "train" \
        else Compare(store, tuple(backbones), tuple(algorithms), opts, out=str(rd.path))
    rd.write_text("config.yaml", dump(command, run_config(cmd, configs)))


def run_config(cmd: Train | Compare, configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The effective configuration of `fedheads train` (one algorithm) or `compare`: every option as
    a config file holds it, then `set`: every config field of the algorithm (compare: `NAME.field`
    for each) as it is built, defaults included. `configs`: {algorithm: the config it was built
    with} (else each is built once here)."""
    names = [cmd.algorithm] if isinstance(cmd, Train) else list(cmd.algorithms)
    fields: dict[str, Any] = {}
    for name in names:
        built = (configs or {}).get(name)
        if built is None:
            built = build_algorithm(name, cmd.options, strict=False)[0]
        prefix = "" if isinstance(cmd, Train) else f"{name}."
        fields.update({prefix + k: v for k, v in resolved_settings(name, built).items()})
    return {**file_config(cmd), "set": fields}


def write_run_files(rd: RunDir, result: dict[str, Any], config: dict[str, Any], rows: list[list[Any]]) -> None:
    """config.json, metrics.csv (fedheads.report.results.metrics_rows), the plots and summary.md of
    one trained head, then results.json (last: the directory is complete); `train`, each member of
    `compare`, and a Flower run (fedheads.flower.results)."""
    rd.write_json("config.json", config)
    rd.write_csv("metrics.csv", report.METRICS_COLUMNS, rows)
    rd.save_figure("accuracy_per_round.png", lambda p: plotting.plot_history([result], p))
    rd.save_figure("per_client.png", lambda p: plotting.plot_per_client([result], p))
    md = report.run_markdown(result) + "\n\n![accuracy per round](accuracy_per_round.png)\n" \
        "![per-client accuracy](per_client.png)\n"
    rd.write_text("summary.md", md)
    rd.finish(result)


def check_compare_settings(algorithms: Sequence[str], opts: TrainOptions) -> None:
    """A plain --set key that no compared algorithm has is refused by name (a typo would
    otherwise be dropped from every one of them); one that some have applies to those.
    Decided from the algorithms' config fields, nothing built."""
    ignored_by = [set(resolve_settings(name, opts, strict=False)[1]) for name in algorithms]
    for key, _ in opts.settings:
        if "." not in key and all(key in ig for ig in ignored_by):
            raise unknown_key_error(key, list(algorithms))


def build_compared(algorithms: Sequence[str], opts: TrainOptions) -> dict[str, tuple[Any, dict[str, Any], list[str]]]:
    """Each compared algorithm built once (what it does not take dropped), so unknown names,
    keys and bad values fail before any training."""
    check_compare_settings(algorithms, opts)
    return {name: build_algorithm(name, opts, strict=False) for name in algorithms}


def compare_data(data: Federation, backbones: Sequence[str], algorithms: Sequence[str], opts: TrainOptions, *,
                 store: str | Path | StoreRecord | None = None,
                 t_start: tuple[float, float] | None = None, load: tuple[float, float] | None = None,
                 out: Path | None = None, resume: bool = False,
                 heap: GlibcHeap | None = None,
                 built: dict[str, tuple[Any, dict[str, Any], list[str]]] | None = None, all_rounds: bool = False,
                 ) -> tuple[dict[str, TrainedRun], dict[str, Any]]:
    """Every algorithm trained on the same features, in memory: ({name: TrainedRun}, the
    comparison's results.json dict). Options that do not apply to an algorithm are dropped and
    recorded (`ignored_options`), as `compare` does. With `out`, each algorithm checkpoints every
    round in out/<algorithm>/state/ (and continues from there with `resume`). `store` and `heap`
    as in train_data (a path is opened once for all algorithms); `built`: what build_compared
    returned (else each algorithm is built here, once)."""
    if t_start is None:
        t_start = clock(torch.device("cpu"))
    built = built or build_compared(algorithms, opts)
    require_test_samples(data)
    record = _store_record(store, backbones)
    runs = {name: train_data(data, backbones, name, opts, store=record, strict=False,
                             state_dir=None if out is None else out / name / "state", resume=resume, heap=heap,
                             built=built[name], all_rounds=all_rounds)
            for name in algorithms}
    combined = {"algorithms": {n: r.result for n, r in runs.items()}, "backbones": list(backbones),
                "dataset": None if record is None else record.dataset,
                "store": None if record is None else record.path, "options": config_dict(opts),
                "environment": environment(),
                "timing": report.timing_block([], *_since(t_start, data.device), machine(data.device), load)}
    return runs, combined


@rundir.holds_lock
def compare_runs(store: str | Path | StoreInfo | None, backbones: Sequence[str], algorithms: Sequence[str],
                 opts: TrainOptions, out: str | Path, overwrite: bool = False, data: Federation | None = None,
                 resume: bool = False, heap: GlibcHeap | None = None, all_rounds: bool = False) -> dict[str, Any]:
    """Train every algorithm on the same cached features (loaded once) and write the comparison.
    An --out (or an <algorithm>/ in it) holding a run is refused unless `overwrite`. `store`,
    `data` and `heap` as in train_run; `resume` continues an interrupted comparison."""
    rd = RunDir(out, algorithms)
    rd.check(overwrite, resume)
    built = build_compared(algorithms, opts)
    if opts.tensorboard:
        from fedheads.run.tracking import require

        require()
    t_start = clock(torch.device("cpu"))  # nothing queued on a device yet
    data, record, load = _features(store, data, backbones, opts, t_start, "compare", heap,
                                   rd.path if resume else None)
    require_test_samples(data)
    for b in built.values():
        _attach(b[0], record)  # a saved run one reads is refused before the run directory is touched
    rd.begin(overwrite)  # resumed: complete again only when rewritten
    runs, combined = compare_data(data, backbones, algorithms, opts, store=record, t_start=t_start, load=load,
                                  out=rd.path, resume=resume, heap=heap, built=built, all_rounds=all_rounds)
    write_comparison(rd, runs, combined, opts)
    return combined


def write_comparison(out: str | Path | RunDir, runs: dict[str, TrainedRun], combined: dict[str, Any],
                     opts: TrainOptions) -> None:
    """A comparison directory (docs/contracts.md, 6): one run directory per algorithm, the table
    and plots, results.json last."""
    rd = out if isinstance(out, RunDir) else RunDir(out, list(runs))
    for name, trained in runs.items():
        write_trained(rd.member(name), trained)
    write_config_yaml(rd, "compare", combined["store"], combined["backbones"], list(runs), opts,
                      configs={n: r.config.get("algorithm_config") for n, r in runs.items()})
    results = list(combined["algorithms"].values())
    where = f" on {report.relative_paths(combined['dataset'], rd.path)}" if combined.get("dataset") else ""
    title = f"{', '.join(combined['backbones'])}{where}: {opts.rounds} rounds"  # the table adds the seeds
    table = report.comparison_markdown(results, title=title)
    rd.save_figure("accuracy_per_round.png", lambda p: plotting.plot_history(results, p))
    rd.save_figure("per_client.png", lambda p: plotting.plot_per_client(results, p))
    rd.write_text("summary.md", f"# Comparison\n\n{table}\n\n![accuracy per round](accuracy_per_round.png)\n"
                  "![per-client accuracy](per_client.png)\n")
    rd.finish(combined)
