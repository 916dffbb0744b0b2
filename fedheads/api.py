"""The Python API of `fedheads`, one function per command; each takes the command's options as
keywords, checked against the same declaration the command line is generated from
(fedheads.run.commands), with the same defaults (except `progress`: no bars unless asked):

    fedheads.train(data, "fedpcl", rounds=..., ...)        -> Result   (`fedheads train`)
    fedheads.compare(data, ["lp", "mlp"], ...)              -> Result   (`fedheads compare`)
    fedheads.predict(run_dir, store | images= | manifest=)  -> table    (`fedheads predict`)
    fedheads.train(...).predict(features)                   -> table    (the trained run's own classifier)
    fedheads.finetune(manifest, store, backbone, out, ...)  -> Result   (`fedheads finetune`)
    fedheads.feddra(manifest, image_encoder, text_encoder, out, ...) -> Result   (`fedheads feddra`)
    fedheads.load(store, backbones)                         -> FedData  (a store's features in memory)
    fedheads.settings(name)                                 -> {key: default} that settings= takes
    fedheads.list_algorithms(), fedheads.register_algorithm(name, factory, description=...)

`data` is a feature store (a path, with `backbones=`) or the features themselves: a mapping
{client: (x_train, y_train, x_test, y_test)} of numpy arrays (or a list of such tuples, or a
`FedData`). Nothing is written unless `out=` is given; then the run directory is exactly the
CLI's (docs/contracts.md, 6). A `Result` has the fields of results.json as attributes. A misspelt
keyword is one UserError with the nearest option, as a misspelt flag is.

Imports stay lazy: `import fedheads` loads neither torch's engines nor faiss, and never timm,
torchvision or dask (`finetune` and `feddra` import the live stage when called)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from fedheads.result import Result
from fedheads.run.commands import Compare, FedDRA, Finetune, Predict, Train
from fedheads.run.options import from_keywords, walk

if TYPE_CHECKING:
    import numpy as np

    from fedheads.core.federation import FedData
    from fedheads.prediction.predict import PredictionSummary

ClientArrays = Sequence[Any]  # (x_train [N, D], y_train [N], x_test [T, D], y_test [T])
Data = Union[str, Path, "FedData", Mapping[str, ClientArrays], Sequence[ClientArrays]]


def _declared(cls: type, *given: str) -> Callable[[Callable], Callable]:
    """The function's signature and docstring from the options `cls` declares: its positional
    arguments `given`, then every option as a keyword with its default and doc (help(), IDEs and
    docs/api.md read them)."""
    def deco(f: Callable) -> Callable:
        opts = [o for o in walk(cls) if o.key not in given and not (o.key == "store" and "data" in given)]
        own = inspect.signature(f)
        params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [inspect.Parameter(o.key, inspect.Parameter.KEYWORD_ONLY, annotation=o.field.type,
                                     default=False if o.key == "progress" else o.default) for o in opts]
        f.__signature__ = inspect.Signature(params, return_annotation=own.return_annotation)  # type: ignore[attr-defined]
        lines = [f"    {o.key}: {o.doc} (default {False if o.key == 'progress' else o.default!r})" for o in opts]
        f.__doc__ = f"{inspect.cleandoc(f.__doc__ or '')}\n\nOptions (keywords):\n\n" + "\n".join(lines)
        return f

    return deco


def _store_or_arrays(data: Any) -> tuple[str | None, Any]:
    """(the store path, None) or (None, the arrays given)."""
    return (str(data), None) if isinstance(data, (str, Path)) else (None, data)


def _prepare(cmd: Train | Compare, arrays: Any) -> tuple[Any, list[str], Any]:
    """(the store: its path, or its record once read here; backbones; in-memory data): a store's
    features are read here when nothing is written (in memory, from one open of the store), else by
    the runner that writes the run directory. The clients are in the store's or the arrays' order."""
    from embedcache.errors import UserError
    from fedheads.run import train as runner

    opts = cmd.options
    if arrays is None:
        if not cmd.backbones:
            raise UserError(f"backbones: needed to read features from the store {cmd.store}")
        if cmd.out is not None:
            return cmd.store, list(cmd.backbones), None
        fed, record = runner.load_store(str(cmd.store), list(cmd.backbones), opts)
        return record, list(cmd.backbones), fed
    from fedheads.run.load import federation_of

    fed = federation_of(arrays, cmd.num_classes, opts.device, opts.binarize, opts.layout)
    return None, list(cmd.backbones or ["features"]), fed


def _quiet(options: dict[str, Any]) -> dict[str, Any]:
    return {"progress": False, **options}


@_declared(Train, "data", "algorithm")
def train(data: Data, algorithm: str, **options: Any) -> Result:
    """Train `algorithm` once per seed, as `fedheads train`.

    data: a feature store path (with `backbones`, concatenated in order) or per-client numpy arrays
    {client: (x_train, y_train, x_test, y_test)}; labels 0..C-1. `settings` holds the algorithm's
    config fields, e.g. {"variant": "code"} (`fedheads algorithms NAME`); `dp` a
    fedheads.privacy.Mechanism or its fields ({"epsilon": 1.0, "clip": 1.0}), or give them as dp_*.
    With `out`, the run directory is written (refused if it holds a run, unless `overwrite`; a
    checkpoint after every round that `resume=True` continues from); without, nothing is written and
    `Result.states` holds each seed's final states."""
    from fedheads.run import train as runner

    store, arrays = _store_or_arrays(data)
    cmd = from_keywords(Train, _quiet(options), "fedheads.train", store=store, algorithm=algorithm)
    _tensorboard(cmd)
    st, bbs, fed = _prepare(cmd, arrays)
    if cmd.out is not None:
        return Result(runner.train_run(st, bbs, algorithm, cmd.options, cmd.out, data=fed, overwrite=cmd.overwrite,
                                       resume=cmd.resume, all_rounds=cmd.all_rounds), cmd.out)
    trained = runner.train_data(fed, bbs, algorithm, cmd.options, store=st, all_rounds=cmd.all_rounds)
    return Result(trained.result, states=trained.states, config=trained.config, per_seed=trained.per_seed)


@_declared(Compare, "data", "algorithms")
def compare(data: Data, algorithms: Sequence[str] | str, **options: Any) -> Result:
    """Train several algorithms on the same features, as `fedheads compare` (`data` as for
    :func:`train`; a setting that does not apply to an algorithm is dropped for it and recorded in its
    `ignored_options`; `{"lp.lr": 0.1}` scopes one to one algorithm). The Result has `algorithms`
    (name -> Result), `backbones`, `options`, `timing`; `out` also writes the table and plots."""
    from fedheads.run import train as runner

    store, arrays = _store_or_arrays(data)
    cmd = from_keywords(Compare, _quiet(options), "fedheads.compare", store=store, algorithms=algorithms)
    _tensorboard(cmd)
    st, bbs, fed = _prepare(cmd, arrays)
    if cmd.out is not None:
        return Result(runner.compare_runs(st, bbs, cmd.algorithms, cmd.options, cmd.out, overwrite=cmd.overwrite,
                                          data=fed, resume=cmd.resume, all_rounds=cmd.all_rounds), cmd.out)
    runs, combined = runner.compare_data(fed, bbs, cmd.algorithms, cmd.options, store=st, all_rounds=cmd.all_rounds)
    combined["algorithms"] = {n: Result(r.result, states=r.states, config=r.config, per_seed=r.per_seed)
                              for n, r in runs.items()}
    return Result(combined)


def _tensorboard(cmd: Train | Compare) -> None:
    if cmd.options.tensorboard and cmd.out is None:
        from embedcache.errors import UserError

        raise UserError("tensorboard: the event files go into the run directory; give out=")


@_declared(Predict, "run", "store")
def predict(run: str | Path, store: str | Path | None = None, **options: Any) -> dict[str, np.ndarray] | PredictionSummary:
    """Classify samples with a trained run directory, as `fedheads predict` (docs/contracts.md, 6c).

    Give one of: `store` (features already extracted), `manifest` (a manifest's `split`, default
    test, each sample by its own client's state) or `images="imagefolder:PATH"` (new images: by the
    run's global model, or `client`'s personalised state, or every client's with client="all"), which
    are extracted with the run's backbones into `cache` after checking the backbones' weights and
    preprocessing against the training features. Returns the table {column: array} (client,
    sample_id, label, label_name, prediction, prediction_name, score; top{j}_label / _name / _score
    when top_k > 1); with `out` (.csv / .parquet) the rows are streamed there instead and a
    PredictionSummary (rows, accuracy per client) is returned."""
    from fedheads.prediction.predict import run_predict

    return run_predict(from_keywords(Predict, _quiet(options), "fedheads.predict", run=str(run),
                                     store=None if store is None else str(store)))


@_declared(Finetune, "manifest", "store", "backbone", "out")
def finetune(manifest: Any, store: str | Path, backbone: str, out: str | Path, **options: Any) -> Result:
    """Fine-tune `backbone` federatedly from a stage-1 head computed on the store, as `fedheads
    finetune` (FedNCM+FT with heads="fedncm", Fed3R+FT "fed3r", FedCOF+FT "fedcof", LP+FT "lp", FT
    "random"; several heads: a comparison). `manifest`: the manifest the store was extracted from
    (path or Manifest). `settings`: the method's settings as `--set` takes them, e.g. {"server":
    "fedadam", "lr": 0.01, "trainable": "after:layer2"} (`--list-settings` lists every key). Always
    writes `out` (a checkpoint after every round, so `resume=True` can continue)."""
    from fedheads.finetuning.runner import finetune_options, finetune_run

    cmd = from_keywords(Finetune, _quiet(options), "fedheads.finetune", manifest=manifest, store=str(store),
                        backbone=backbone, out=str(out))
    return Result(finetune_run(manifest, str(store), backbone, out, finetune_options(cmd.run)), out)


@_declared(FedDRA, "manifest", "image_encoder", "text_encoder", "out")
def feddra(manifest: Any, image_encoder: str, text_encoder: str, out: str | Path, **options: Any) -> Result:
    """FedDRA and its baselines on a paired (image, text) manifest, as `fedheads feddra`: `store` (a
    keyword) holds the encoders' token states for stage 1 (without it stage 1 encodes live);
    `baselines` the presets (several: a comparison); `settings` FedDRA's settings as `--set` takes
    them, e.g. {"rho": 0.1, "steps": 5}; `preset` ("paper" | "quick") the defaults of those not
    given. Always writes `out`."""
    from fedheads.alignment.runner import feddra_options, feddra_run

    cmd = from_keywords(FedDRA, _quiet(options), "fedheads.feddra", manifest=manifest, image_encoder=image_encoder,
                        text_encoder=text_encoder, out=str(out))
    return Result(feddra_run(manifest, cmd.store, image_encoder, text_encoder, out, feddra_options(cmd.run)), out)


def load(store: str | Path, backbones: Sequence[str] | str, *, device: str = "auto", binarize: bool = False,
         layout: str = "padded") -> FedData:
    """A store's features held in memory as a federation (clients in the store's order), to train
    several runs on without reading the store again: `data` for :func:`train` and :func:`compare`,
    which run it in the layout it has."""
    from fedheads.run.load import load_fed_data

    names = [b.strip() for b in backbones.split(",")] if isinstance(backbones, str) else list(backbones)
    return load_fed_data(str(store), names, device, binarize=binarize, layout=layout)


def settings(name: str) -> dict[str, Any]:
    """{key: default} of what `settings=` (`--set`) takes for an algorithm, or for the method of
    "finetune" or "feddra" (`fedheads algorithms NAME` and `--list-settings` describe them)."""
    from fedheads.run.settings import command_settings, settings_of

    if name in ("finetune", "feddra"):
        import importlib

        module = {"finetune": "fedheads.finetuning.runner", "feddra": "fedheads.alignment.runner"}[name]
        rows = command_settings(importlib.import_module(module).SETTINGS)
    else:
        rows = settings_of(name)[0]
    return {r.key: r.default for r in rows}


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
