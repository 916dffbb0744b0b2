"""What the Python API returns for a trained run: results.json as an object (fedheads.api)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from fedheads.prediction.predict import PredictionSummary


class Result(Mapping[str, Any]):
    """A results.json as an object: `res.accuracy["mean"]`, `res["per_client"]`, `res.to_json()`.

    The fields are those of docs/contracts.md, section 6 (a comparison: `res.algorithms` maps
    each algorithm to its own Result). `run_dir` is where it was written (None: in memory);
    `states` maps each seed to its final client and server states and `per_seed` lists each seed's
    own result (per-client accuracy, history, communication; in-memory training only)."""

    def __init__(self, fields: Mapping[str, Any], run_dir: str | Path | None = None,
                 states: Mapping[int, Any] | None = None, config: Mapping[str, Any] | None = None,
                 per_seed: Sequence[Mapping[str, Any]] = ()) -> None:
        self._fields = dict(fields)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.states = dict(states or {})
        self.config = None if config is None else dict(config)  # config.json's dict (in-memory runs)
        self.per_seed = [dict(s) for s in per_seed]

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
        from fedheads.prediction.predict import open_trained, predict_array
        from fedheads.run.saved import trained_from

        if "algorithms" in self._fields:
            raise UserError("Result.predict: a comparison; predict with one of res.algorithms[NAME]")
        if features is None:
            if self.run_dir is None:
                raise UserError("Result.predict: store=/images=/manifest= need a run directory (train with out=)")
            from fedheads.prediction.predict import run_predict
            from fedheads.run.commands import Predict
            from fedheads.run.options import from_keywords

            given = {"progress": False, **kw, "client": client, "seed": seed, "top_k": top_k, "device": device}
            return run_predict(from_keywords(Predict, given, "Result.predict", run=str(self.run_dir)))
        if kw:
            raise UserError(f"Result.predict: features given; {', '.join(kw)} do not apply")
        if self.states and self.config is not None:
            tr = trained_from(self.config, self._fields, self.states, seed, device)
        elif self.run_dir is not None:
            tr = open_trained(self.run_dir, seed, device)
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
