"""The Python API of `fedheads`, one function per command (the CLI takes the same arguments):

    fedheads.train(data, "fedpcl", ...)        -> Result   (`fedheads train`)
    fedheads.compare(data, ["lp", "mlp"], ...) -> Result   (`fedheads compare`)
    fedheads.predict(run_dir, store | images= | manifest=, ...) -> table  (`fedheads predict`)
    fedheads.train(...).predict(features)      -> table    (the trained run's own classifier)
    fedheads.finetune(manifest, store, backbone, out, ...) -> Result   (`fedheads finetune`)
    fedheads.list_algorithms(), fedheads.register_algorithm(name, factory, description=...)

`data` is a feature store (a path, with `backbones=`) or the features themselves: a mapping
{client: (x_train, y_train, x_test, y_test)} of numpy arrays (or a list of such tuples, or a
`FedData`). Nothing is written unless `out=` is given; then the run directory is exactly the
CLI's (docs/contracts.md, 6). A `Result` has the fields of results.json as attributes.

Imports stay lazy: `import fedheads` loads neither the engines nor faiss, and never timm,
torchvision or dask (`finetune` imports the live stage when called)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import numpy as np

    from fedheads.core.federation import FedData
    from fedheads.prediction.predict import PredictionSummary

ClientArrays = Sequence[Any]  # (x_train [N, D], y_train [N], x_test [T, D], y_test [T])
Data = Union[str, Path, "FedData", Mapping[str, ClientArrays], Sequence[ClientArrays]]


class Result(Mapping[str, Any]):
    """A results.json as an object: `res.accuracy["mean"]`, `res["per_client"]`, `res.to_json()`.

    The fields are those of docs/contracts.md, section 6 (a comparison: `res.algorithms` maps
    each algorithm to its own Result). `run_dir` is where it was written (None: in memory);
    `states` maps each seed to its final client and server states (in-memory training only)."""

    def __init__(self, fields: Mapping[str, Any], run_dir: str | Path | None = None,
                 states: Mapping[int, Any] | None = None, config: Mapping[str, Any] | None = None) -> None:
        self._fields = dict(fields)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.states = dict(states or {})
        self.config = None if config is None else dict(config)  # config.json's dict (in-memory runs)

    def __getitem__(self, key: str) -> Any:
        value = self._fields[key]
        if key == "algorithms" and isinstance(value, Mapping):
            return {k: v if isinstance(v, Result) else Result(v) for k, v in value.items()}
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"Result has no field {name!r} (fields: {', '.join(self._fields)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        what = self._fields.get("algorithm") or ",".join(self._fields.get("algorithms", {}))
        cell = self._fields.get("accuracy_cell")
        return f"Result({what}{': ' + cell if cell else ''}{', ' + str(self.run_dir) if self.run_dir else ''})"

    def predict(self, features: Any = None, *, client: str | None = None, seed: int | None = None,
                top_k: int = 1, device: str = "cpu", **kw: Any) -> dict[str, np.ndarray] | PredictionSummary:
        """Classify with this trained run, as `fedheads predict`: `features` [N, D] (the run's
        backbones concatenated) through the final states of `seed` (default the first) -> the table
        (prediction = class index, prediction_name, score, ...; sample_id = row number); by `client`'s
        state, every client's ("all"), or the global model (None). Or, for a run written to a run
        directory, any of fedheads.predict's inputs: store=, images=, manifest= (same options)."""
        from embedcache.errors import UserError
        from fedheads.prediction.predict import predict_array
        from fedheads.run.saved import open_run, trained_from

        if "algorithms" in self._fields:
            raise UserError("Result.predict: a comparison; predict with one of res.algorithms[NAME]")
        if features is None:
            if self.run_dir is None:
                raise UserError("Result.predict: store=/images=/manifest= need a run directory (train with out=)")
            return predict(self.run_dir, client=client, seed=seed, top_k=top_k, device=device, **kw)
        if kw:
            raise UserError(f"Result.predict: features given; {', '.join(kw)} do not apply")
        if self.states and self.config is not None:
            tr = trained_from(self.config, self._fields, self.states, seed, device)
        elif self.run_dir is not None:
            tr = open_run(self.run_dir, seed, device)
        else:
            raise UserError("Result.predict: this result holds no trained states")
        return predict_array(tr, features, client=client, top_k=top_k)

    def to_dict(self) -> dict[str, Any]:
        """results.json's dict (a copy)."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        """results.json's text."""
        return json.dumps(self._fields, indent=2, sort_keys=True,
                          default=lambda o: o._fields if isinstance(o, Result) else str(o))


def _federation(data: Any, num_classes: int | None, device: str, binarize: bool, layout: str = "padded") -> Any:
    """A federation from numpy arrays per client in `layout` (a FedData given is used as it is).
    "auto" stacks arrays padded, as before layouts existed: their padding is the caller's arrays'."""
    import numpy as np

    from embedcache.errors import UserError
    from fedheads.core.federation import FedData
    from fedheads.run.load import from_arrays

    if isinstance(data, FedData):
        return data
    if isinstance(data, Mapping):
        names, clients = [str(k) for k in data], list(data.values())
    else:
        names, clients = None, list(data)
    for i, c in enumerate(clients):
        if not isinstance(c, (tuple, list)) or len(c) != 4:
            who = names[i] if names else f"client #{i}"
            raise UserError(f"{who}: expected (x_train, y_train, x_test, y_test), got {type(c).__name__}")
    if num_classes is None:  # labels are 0..C-1
        tops = [int(np.max(y)) for c in clients for y in (c[1], c[3]) if len(y)]
        num_classes = max(tops) + 1 if tops else 0
    return from_arrays([tuple(c) for c in clients], num_classes, names, device=device, binarize=binarize,
                       layout="padded" if layout == "auto" else layout)


def _options(rounds: int, seeds: Sequence[int] | int, local_epochs: int | None, batch_size: int | None,
             lr: float | None, fraction: float, engine: str, layout: str, device: str, eval_every: int, binarize: bool,
             settings: Mapping[str, Any] | None, progress: bool, tensorboard: bool = False, dp: Any = None) -> Any:
    from embedcache.errors import UserError
    from fedheads.privacy import mechanism
    from fedheads.run.train import TrainOptions

    if rounds < 1:
        raise UserError(f"rounds {rounds}: must be >= 1")
    seeds = (seeds,) if isinstance(seeds, int) else tuple(int(s) for s in seeds)
    if not seeds:
        raise UserError("seeds: at least one is needed")
    fields = tuple((str(k).replace("-", "_"), v) for k, v in (settings or {}).items())
    return TrainOptions(rounds=rounds, seeds=seeds, fraction=fraction, engine=engine, layout=layout, device=device,
                        eval_every=eval_every, binarize=binarize, local_epochs=local_epochs,
                        batch_size=batch_size, lr=lr, settings=fields, progress=progress, tensorboard=tensorboard,
                        dp=mechanism(dp))


def _tensorboard(on: bool, out: Any) -> bool:
    if on and out is None:
        from embedcache.errors import UserError

        raise UserError("tensorboard: the event files go into the run directory; give out=")
    return on


def _prepare(data: Data, backbones: Sequence[str] | str | None, num_classes: int | None, opts: Any,
             load: bool) -> tuple[Any, list[str], Any]:
    """(the store: its path, or its record once read here; backbones; in-memory data): a store's
    features are read here when `load` (in memory, from one open of the store), else by the
    runner that writes the run directory. The clients are in the store's or the arrays' order."""
    from embedcache.errors import UserError
    from fedheads.run import train as runner

    if isinstance(backbones, str):
        backbones = [b.strip() for b in backbones.split(",") if b.strip()]
    if isinstance(data, (str, Path)):
        if not backbones:
            raise UserError(f"backbones: needed to read features from the store {data}")
        if not load:
            return str(data), list(backbones), None
        fed, record = runner.load_store(str(data), list(backbones), opts)
        return record, list(backbones), fed
    return None, list(backbones or ["features"]), _federation(data, num_classes, opts.device, opts.binarize,
                                                              opts.layout)


def train(data: Data, algorithm: str, *, backbones: Sequence[str] | str | None = None,
          num_classes: int | None = None, rounds: int = 50, seeds: Sequence[int] | int = (0, 1, 2),
          local_epochs: int | None = None, batch_size: int | None = None, lr: float | None = None,
          fraction: float = 1.0, engine: str = "vectorized", layout: str = "auto", device: str = "auto",
          eval_every: int = 1, binarize: bool = False, settings: Mapping[str, Any] | None = None, progress: bool = False,
          out: str | Path | None = None, overwrite: bool = False, resume: bool = False,
          tensorboard: bool = False, dp: Any = None) -> Result:
    """Train `algorithm` once per seed, as `fedheads train`.

    data: a feature store path (with `backbones`, concatenated in order) or per-client numpy
        arrays {client: (x_train, y_train, x_test, y_test)}; labels 0..C-1 (`num_classes`
        defaults to the largest label + 1).
    layout: how clients are stacked ("padded" | "bucketed" | "auto": bucketed when padding would cost,
        streamed when a store's features would take more than half the memory available |
        "streamed": the buckets read as each round needs them, so a run holds one bucket, not the features).
    settings: algorithm config fields, e.g. {"variant": "code"} (see `fedheads algorithms NAME`);
        local_epochs / batch_size / lr: the generic ones (None: the paper's default).
    out: write the run directory there (refused if it holds a run, unless `overwrite`), with a
        checkpoint after every round that `resume=True` continues from (and, with `tensorboard`,
        per-round TensorBoard scalars: extra [tensorboard]);
        None: nothing is written and `Result.states` holds each seed's final states.
    dp: train under differential privacy (algorithms with a DP form: FedNCM, Fed3R, CCVR calibrating
        a saved head; FedPFT with mode "local"): a fedheads.privacy.Mechanism or its fields, e.g. {"epsilon": 1.0, "delta": 1e-5,
        "clip": 1.0}; results.json's `privacy` then records the mechanism and the epsilon spent."""
    from fedheads.run import train as runner

    opts = _options(rounds, seeds, local_epochs, batch_size, lr, fraction, engine, layout, device, eval_every,
                    binarize, settings, progress, _tensorboard(tensorboard, out), dp)
    store, bbs, fed = _prepare(data, backbones, num_classes, opts, load=out is None)
    if out is not None:
        return Result(runner.train_run(store, bbs, algorithm, opts, out, data=fed, overwrite=overwrite,
                                       resume=resume), out)
    trained = runner.train_data(fed, bbs, algorithm, opts, store=store)
    return Result(trained.result, states=trained.states, config=trained.config)


def compare(data: Data, algorithms: Sequence[str] | str, *, backbones: Sequence[str] | str | None = None,
            num_classes: int | None = None, rounds: int = 50, seeds: Sequence[int] | int = (0, 1, 2),
            local_epochs: int | None = None, batch_size: int | None = None, lr: float | None = None,
            fraction: float = 1.0, engine: str = "vectorized", layout: str = "auto", device: str = "auto",
            eval_every: int = 1, binarize: bool = False, settings: Mapping[str, Any] | None = None, progress: bool = False,
            out: str | Path | None = None, overwrite: bool = False, resume: bool = False,
            tensorboard: bool = False, dp: Any = None) -> Result:
    """Train several algorithms on the same features, as `fedheads compare` (arguments as in
    :func:`train`; a setting that does not apply to an algorithm is dropped for it and recorded
    in its `ignored_options`; `{"lp.lr": 0.1}` scopes one to one algorithm). The Result has
    `algorithms` (name -> Result), `backbones`, `options`, `timing`; `out` also writes the
    table and plots."""
    from fedheads.run import train as runner

    names = [a.strip() for a in algorithms.split(",") if a.strip()] if isinstance(algorithms, str) else list(algorithms)
    opts = _options(rounds, seeds, local_epochs, batch_size, lr, fraction, engine, layout, device, eval_every,
                    binarize, settings, progress, _tensorboard(tensorboard, out), dp)
    store, bbs, fed = _prepare(data, backbones, num_classes, opts, load=out is None)
    if out is not None:
        return Result(runner.compare_runs(store, bbs, names, opts, out, overwrite=overwrite, data=fed,
                                          resume=resume), out)
    runs, combined = runner.compare_data(fed, bbs, names, opts, store=store)
    combined["algorithms"] = {n: Result(r.result, states=r.states, config=r.config) for n, r in runs.items()}
    return Result(combined)


def predict(run: str | Path, store: str | Path | None = None, *, images: str | None = None,
            manifest: Any = None, split: str | None = None, client: str | None = None, seed: int | None = None,
            top_k: int = 1, cache: str | Path | None = None, chunk_rows: int = 65536, device: str = "cpu",
            batch_size: int | None = None, num_workers: int = 2, weights_dir: str | None = None,
            plugins: Sequence[str] = (), progress: bool = False,
            out: str | Path | None = None) -> dict[str, np.ndarray] | PredictionSummary:
    """Classify samples with a trained run directory, as `fedheads predict` (docs/contracts.md, 6c).

    Give one of: `store` (features already extracted), `manifest` (a manifest's `split`, default
    test, each sample by its own client's state) or `images="imagefolder:PATH"` (new images: by the run's
    global model, or `client`'s personalised state, or every client's with client="all"). New
    images are extracted with the run's backbones into `cache` (default RUN_DIR/predict-cache),
    after checking the backbones' weights and preprocessing against the training features.
    Returns the table {column: array} (client, sample_id, label, label_name, prediction,
    prediction_name, score; top{j}_label / _name / _score when top_k > 1); with `out` (.csv /
    .parquet) the rows are streamed there instead and a PredictionSummary (rows, accuracy per
    client) is returned."""
    from fedheads.prediction.predict import run_predict

    return run_predict(run, store, images=images, manifest=manifest, split=split, client=client, seed=seed,
                       top_k=top_k, cache=cache, device=device, batch_size=batch_size, num_workers=num_workers,
                       weights_dir=weights_dir, plugins=plugins, progress=progress, chunk_rows=chunk_rows, out=out)


def finetune(manifest: Any, store: str | Path, backbone: str, out: str | Path, *,
             heads: Sequence[str] | str = ("fedncm",), rounds: int = 10, settings: Mapping[str, Any] | None = None,
             fraction: float = 1.0, seeds: Sequence[int] | int = (0,), eval_every: int = 1, device: str = "auto",
             num_workers: int = 2, weights_dir: str | None = None, resume: bool = False, overwrite: bool = False,
             progress: bool = False, **former: Any) -> Result:
    """Fine-tune `backbone` federatedly from a stage-1 head computed on the store, as `fedheads
    finetune` (FedNCM+FT with heads="fedncm", Fed3R+FT "fed3r", FedCOF+FT "fedcof", LP+FT "lp",
    FT "random"; several heads:
    a comparison). `manifest`: the manifest the store was extracted from (path or Manifest).
    `settings`: the method's settings as `fedheads finetune --set` takes them, e.g.
    {"server": "fedadam", "lr": 0.01, "trainable": "after:layer2"} (`--dump-config` lists every
    key). The former keywords (server=, lr=, pretrained=, ...) still work for one release, each
    with a FutureWarning naming its settings key. Always writes `out` (a checkpoint after every
    round, so `resume=True` can continue)."""
    import warnings

    from fedheads.finetuning.runner import SETTINGS, finetune_options, finetune_run

    keys = {f.name for part in SETTINGS for f in part.fields()}
    unknown = sorted(set(former) - keys)
    if unknown:
        raise TypeError(f"finetune() got an unexpected keyword argument {unknown[0]!r}")
    for k, v in former.items():
        warnings.warn(f"fedheads.finetune({k}=...) is now settings={{{k!r}: {v!r}}} (kept for one release)",
                      FutureWarning, stacklevel=2)
    names = tuple(h.strip() for h in heads.split(",")) if isinstance(heads, str) else tuple(heads)
    items = [*former.items(), *(settings or {}).items()]  # settings= wins over a former keyword
    opts = finetune_options(items, heads=names, rounds=rounds, fraction=fraction,
                            seeds=(seeds,) if isinstance(seeds, int) else tuple(seeds), eval_every=eval_every,
                            device=device, num_workers=num_workers, weights_dir=weights_dir, resume=resume,
                            overwrite=overwrite, progress=progress)
    return Result(finetune_run(manifest, str(store), backbone, out, opts), out)


def list_algorithms() -> list[Any]:
    """The registered algorithms (name, description, factory), as `fedheads algorithms`."""
    from fedheads.algorithms import list_algorithms as registry

    return registry()


def register_algorithm(name: str, factory: Any, *, description: str, config: type | None = None,
                       fixed: dict[str, str] | None = None) -> None:
    """Make `factory(**config_fields) -> Algorithm` trainable as `name` by every engine, the
    CLI included (from a module it imports). `config`: its config dataclass, whose fields
    (declared with fedheads.core.config.setting) are the keys `--set` takes. See
    docs/custom_algorithm.md."""
    from fedheads.algorithms import register_algorithm as register

    register(name, factory, description=description, config=config, fixed=fixed)
