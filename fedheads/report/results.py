"""Run summaries (results.json), Markdown tables laid out like the papers' and PNG plots.

Everything takes and returns plain dicts in the results.json contract, so the CLI only
calls :func:`summarise_runs` and the writers (the PNGs: :mod:`fedheads.report.plotting`):

``algorithm, backbones, rounds, seeds, accuracy{mean,std}, per_client{client:{mean,std,n_test}},
clients_without_test,
fairness{average,worst_10,worst_20,worst_40,best_10,variance}, communication{
upload_params_per_client_per_round, upload_bytes_total, download_bytes_total,
paper_comm_params_per_client_per_round, paper_upload_bytes, paper_download_bytes,
paper_total_bytes}, trainable_params_per_client, paper_trainable_params_per_client,
history[{round, accuracy, std, clients_seen}], std_ddof, std_convention``

Accuracies are percent; "mean(std)" is over seeds with the sample std (``ddof=1``, as the
FedPCL authors' torch.std; ``std_ddof`` records the one used, see :mod:`fedheads.report.metrics`).
The fairness block holds the seed means (and ``fairness_std`` the seed stds), as in FedPCL
Tables 12-13. The paper_* communication figures follow :func:`fedheads.report.communication.paper_comm_bytes`
(per direction: FedPCL downloads (m+1) x C x d per client and round).

Every client stays visible: one with no test samples keeps its entry in ``per_client``
(``{"mean": None, "std": None, "n_test": 0}``), shows as "n/a (0 test)" in every table with a
footnote naming it, and as an empty, labelled slot in the per-client plot; the aggregates
(accuracy, fairness, history) are over the clients with test samples (docs/contracts.md, 6).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embedcache.atomic import atomic_path
from embedcache.errors import UserError
from fedheads.report import communication as comm
from fedheads.report import metrics, plotting, strict_json


def one_pass(algorithm: Any) -> bool:
    """Whether the registered algorithm `algorithm` communicates once whatever `rounds` says
    (AlgorithmBase.one_pass: FedNCM Alg. 1, Fed3R, FedCOF); `train`/`compare` run it for one
    round when every client takes part (fedheads.run.train.rounds_needed). False for a name the
    registry does not hold (a fine-tuning run's "fedncm+ft"). A built algorithm is read as it is."""
    from fedheads.algorithms import create_algorithm

    if not isinstance(algorithm, str):
        return bool(algorithm.one_pass)

    try:
        return bool(create_algorithm(comm.method_key(algorithm)).one_pass)
    except UserError:
        return False


def _atomic_write(path: Path, write: Any, binary: bool = False) -> Path:
    with atomic_path(path) as tmp, open(tmp, "wb" if binary else "w") as fh:
        write(fh)
    return path


def seed_result_from_run(run: Any, seed: int, client_names: Sequence[str],
                         rule: str = "main", n_test: Sequence[int] | None = None) -> dict[str, Any]:
    """One per-seed entry for :func:`summarise_runs` from an engine ``RunResult``
    (``client_names`` aligned with its client axis, e.g. ``FedData.client_names``; ``n_test``
    their test sample counts, e.g. ``FedData.n_test``).

    Accuracies become percent; clients with no test rows (NaN) have no accuracy and are
    listed under ``clients_without_test``."""
    final = run.final_accuracy(rule)
    names = list(client_names)
    if len(names) != len(final):
        raise UserError(f"client_names: {len(names)} names for {len(final)} clients")
    per_client, empty = {}, []
    for name, acc in zip(names, final.tolist()):
        (empty.append(name) if acc != acc else per_client.__setitem__(name, 100.0 * acc))
    history = []
    seen: set[int] = set()
    for rec in run.history:
        seen.update(rec.participants)
        if rec.accuracy is not None:
            a = rec.accuracy[rule]
            history.append({"round": int(rec.round) + 1,  # after round r (1-based, as papers plot)
                            "accuracy": 100.0 * float(a[~a.isnan()].mean()),
                            "clients_seen": len(seen)})  # distinct clients so far (Fed3R's accuracy-vs-clients curves)
    out = {"seed": int(seed), "per_client": per_client, "history": history,
           "communication": comm.ledger_from_rounds(run.history).summary(),
           "trainable_params_per_client": int(run.trainable_params_per_client),
           "clients_without_test": empty, "timing": run_timing(run)}
    if n_test is not None:
        out["n_test"] = {n: int(k) for n, k in zip(names, n_test)}
    return out


METRICS_COLUMNS = ("round", "seed", "client", "rule", "accuracy")  # metrics.csv of train, compare, Flower runs


def metrics_rows(run: Any, seed: int, client_names: Sequence[str]) -> list[list[Any]]:
    """metrics.csv rows (METRICS_COLUMNS) of an engine ``RunResult``: every evaluated round x
    client x rule, accuracy in percent rounded to 4 places (empty for a client without test samples)."""
    rows = []
    for rec in run.history:
        if rec.accuracy is None:
            continue
        for rule, acc in rec.accuracy.items():
            for name, a in zip(client_names, acc.tolist()):
                rows.append([rec.round + 1, seed, name, rule, "" if a != a else round(100.0 * a, 4)])
    return rows


def _r(x: float) -> float:
    return round(float(x), 4)


def run_timing(run: Any) -> dict[str, Any]:
    """Seconds of one engine run (docs/contracts.md, results.json "timing"): the whole run and
    each round's training (client updates + aggregation) and evaluation, wall and process CPU."""
    h = run.history
    cols = {"train_wall_seconds": [r.seconds for r in h], "train_cpu_seconds": [r.cpu_seconds for r in h],
            "eval_wall_seconds": [r.eval_seconds for r in h], "eval_cpu_seconds": [r.eval_cpu_seconds for r in h]}
    return {"wall_seconds": _r(run.wall_seconds), "cpu_seconds": _r(run.cpu_seconds),
            **{k: _r(sum(v)) for k, v in cols.items()},
            "rounds": {k: [_r(x) for x in v] for k, v in cols.items()},
            "resumed_from_round": getattr(run, "resumed_from", None)}


def timing_block(per_seed: Sequence[Mapping[str, Any]], wall: float, cpu: float, machine: Mapping[str, Any],
                 load: tuple[float, float] | None = None) -> dict[str, Any]:
    """results.json "timing": the whole command (`wall`/`cpu` seconds), the feature loading it
    did (None when the features were loaded once for several runs), each seed's run, the machine."""
    return {"wall_seconds": _r(wall), "cpu_seconds": _r(cpu),
            "load_wall_seconds": None if load is None else _r(load[0]),
            "load_cpu_seconds": None if load is None else _r(load[1]),
            "per_seed": [{"seed": s["seed"], **s["timing"]} for s in per_seed if s.get("timing")],
            "machine": dict(machine)}


def timing_markdown(result: Mapping[str, Any]) -> list[str]:
    """One line on how long the run took, where (empty without a timing block)."""
    t = result.get("timing")
    if not t:
        return []
    seeds = t.get("per_seed") or []
    tr = [x for s in seeds for x in s["rounds"]["train_wall_seconds"]]
    ev = [x for s in seeds for x in s["rounds"]["eval_wall_seconds"] if x > 0]
    m = t.get("machine", {})
    per_round = (f"; per round, median: training {np.median(tr):.3g} s" if tr else "") + \
        (f", evaluation {np.median(ev):.3g} s" if ev else "")
    where = f"{m.get('device', '?')}" + (f" ({m['gpu']})" if m.get("gpu") else "") + \
        f", {m.get('threads', '?')} threads on {m.get('usable_cpus', m.get('cpu_count', '?'))} CPUs ({m.get('cpu_model', '?')})"
    return [f"- time: {t['wall_seconds']:.3g} s wall, {t['cpu_seconds']:.3g} s CPU for {len(seeds)} seed(s)"
            f"{per_round}; {where}"]


def summarise_runs(per_seed: Sequence[Mapping[str, Any]], *, algorithm: str,
                   backbones: Sequence[str], rounds: int,
                   feature_dims: Sequence[int] | None = None, num_classes: int | None = None,
                   proj_dim: int = 256, fraction: float = 1.0,
                   extra: Mapping[str, Any] | None = None,
                   ddof: int = metrics.STD_DDOF, built: Any = None) -> dict[str, Any]:
    """Build one results.json dict from per-seed runs.

    Each seed is ``{"seed": int, "per_client": {client: acc%}, "history": [{round,
    accuracy}] (optional), "communication": CommLedger.summary() (optional),
    "trainable_params_per_client": int (optional), "clients_without_test": [client]
    (optional), "n_test": {client: int} (optional)}``. ``feature_dims`` (one per backbone)
    and ``num_classes`` enable the papers' conventions (FedPCL Table 2/14, FedNCM App. A);
    algorithms with no published convention get ``None`` there. ``ddof`` is that of every std
    over seeds (default: the sample std, as the papers' authors). ``built``: the run's algorithm
    object, whose own convention is used (else the registered name's default is built)."""
    if not per_seed:
        raise UserError("per_seed: no seed results to summarise")
    for i, s in enumerate(per_seed):
        if "per_client" not in s:
            raise UserError(f"seed #{i}: 'per_client' accuracies missing")
        if not s["per_client"]:
            empty = list(s.get("clients_without_test") or [])
            raise UserError(f"seed #{i}: no client has test samples"
                            + (f" (e.g. {empty[0]}: 0)" if empty else ""))
    accs = [dict(s["per_client"]) for s in per_seed]
    overall, per_client = metrics.summarise_accuracy(accs, ddof)  # over clients with test samples
    fair = metrics.fairness_over_seeds(accs, ddof)
    without = sorted({c for s in per_seed for c in s.get("clients_without_test") or ()} - set(per_client))
    for c in without:  # still listed: a client never silently drops out of a report
        per_client[c] = {"mean": None, "std": None, "n_test": 0}
    counts = per_seed[0].get("n_test") or {}
    for c, v in per_client.items():
        if c in counts:
            v["n_test"] = int(counts[c])
    n_clients = len(per_client)  # every client communicates, evaluated or not

    measured = [s["communication"] for s in per_seed if s.get("communication")]
    keys = ("upload_params_per_client_per_round", "upload_bytes_total", "download_bytes_total")
    comm_out: dict[str, Any] = {k: (float(np.mean([m[k] for m in measured])) if measured else None)
                                for k in keys}
    paper_params = paper_trainable = paper_bytes = None
    comm_rounds = 1 if one_pass(algorithm if built is None else built) else rounds
    if feature_dims is not None and num_classes is not None:
        arch = comm.HeadArch(tuple(int(d) for d in feature_dims), proj_dim, num_classes)
        who = algorithm if built is None else built  # the run's algorithm object: not built again
        if comm.round_comm_of(who, arch, 1) is not None:  # else no published convention for this algorithm
            paper_params = comm.fedpcl_comm_params(who, arch)
            paper_bytes = comm.paper_comm_bytes(who, arch, n_clients, comm_rounds, fraction)
        if comm.method_key(algorithm) in comm.FEDPCL_TABLE2_METHODS:  # same head (FedPCL Sec. 5.1)
            paper_trainable = comm.fedpcl_trainable_params(arch)
    comm_out["paper_comm_params_per_client_per_round"] = paper_params
    comm_out["paper_upload_bytes"] = None if paper_bytes is None else paper_bytes[0]
    comm_out["paper_download_bytes"] = None if paper_bytes is None else paper_bytes[1]
    comm_out["paper_total_bytes"] = None if paper_bytes is None else sum(paper_bytes)
    if comm_out["download_bytes_total"] == 0:  # a bare 0 would read as a free head
        comm_out["download_note"] = ("0 B measured: the clients receive nothing while training (the head stays on the "
                                     "server, where the evaluation reads it); a deployment sends it to each client "
                                     "once to use it" + ("" if paper_bytes is None else
                                                         " (paper_download_bytes: the papers' count)"))

    trainable = [s["trainable_params_per_client"] for s in per_seed
                 if s.get("trainable_params_per_client") is not None]
    result: dict[str, Any] = {
        "algorithm": algorithm,
        "backbones": list(backbones),
        "rounds": int(rounds),
        "seeds": [s.get("seed", i) for i, s in enumerate(per_seed)],
        "accuracy": overall,
        "accuracy_cell": mean_std_cell(overall["mean"], overall["std"], len(per_seed)),
        "per_client": dict(sorted(per_client.items())),
        "clients_without_test": without,
        "fairness": {k: v["mean"] for k, v in fair.items()},
        "fairness_std": {k: v["std"] for k, v in fair.items()},
        "fairness_variance_unit": "population std of client accuracies, percentage points",
        "communication": comm_out,
        "trainable_params_per_client": int(trainable[0]) if trainable else None,
        "paper_trainable_params_per_client": paper_trainable,
        "history": metrics.aggregate_history([s.get("history", []) for s in per_seed], ddof),
        "std_ddof": int(ddof),
        "std_convention": metrics.std_convention(ddof),
    }
    if extra:
        result.update(extra)
    return result


def write_results_json(result: Mapping[str, Any], path: str | Path) -> Path:
    """results.json, atomically, sorted keys, strict JSON (non-finite numbers as null)."""
    return _atomic_write(Path(path), lambda fh: fh.write(strict_json.dumps(result)))


NO_TEST = "n/a (0 test)"
DROPPED = "n/a (dropped)"  # a Flower node that left before the last evaluation


def mean_std_cell(mean: float, std: float | None, n_seeds: int | None) -> str:
    """"mean(std)" over seeds; one seed has no spread to show, so its cell says "mean (n=1)"
    rather than a std of 0.00 that reads like a measured spread."""
    if n_seeds == 1 or std is None:
        return f"{mean:.2f} (n=1)" if n_seeds == 1 else f"{mean:.2f}"
    return metrics.format_mean_std(mean, std)


def _n_seeds(result: Mapping[str, Any]) -> int | None:
    seeds = result.get("seeds")
    return len(seeds) if isinstance(seeds, (list, tuple)) and seeds else None


def seeds_phrase(results: Sequence[Mapping[str, Any]]) -> str:
    """"seeds 0, 1, 2", "seed 0 (n=1)", or per method when they differ ("" when none recorded)."""
    def one(seeds: Sequence[Any]) -> str:
        return f"seed {seeds[0]} (n=1)" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"

    got = [list(r.get("seeds") or []) for r in results]
    if not any(got):
        return ""
    if all(g == got[0] for g in got):
        return one(got[0])
    return "; ".join(f"{r['algorithm']} {one(g)}" for r, g in zip(results, got) if g)


_ABS_PATH = re.compile(r"(?:(?<=^)|(?<=[\s:=(\[,'\"]))(/(?!/)[^\s:,;)\]'\"]*)")  # not a URL's //host


def relative_paths(text: str, run_dir: str | os.PathLike) -> str:
    """`text` (a title, a source spec such as "imagefolder:/srv/data") with each absolute path
    written relative to `run_dir`, where the report lies: a report names no home directory and
    stays right when the run and its data are moved together."""
    base = os.path.abspath(run_dir)
    return _ABS_PATH.sub(lambda m: os.path.relpath(m.group(1), base), text)


def _cell(d: Mapping[str, Any] | None, n_seeds: int | None = None) -> str:
    if d is None:
        return "-"
    if d["mean"] is None:
        return DROPPED if d.get("dropped") else NO_TEST
    return mean_std_cell(d["mean"], d["std"], n_seeds)


def _no_test_note(results: Sequence[Mapping[str, Any]]) -> str:
    """The footnote naming clients without test samples ("" when there are none)."""
    names = sorted({c for r in results for c, v in r["per_client"].items() if v.get("mean") is None and not v.get("dropped")})
    gone = sorted({c for r in results for c, v in r["per_client"].items() if v.get("mean") is None and v.get("dropped")})
    if not names and not gone:
        return ""
    n = len({c for r in results for c in r["per_client"]}) - len(names) - len(gone)
    parts = [f"{NO_TEST}: {', '.join(names)} {'has' if len(names) == 1 else 'have'} no test samples"] if names else []
    parts += [f"{DROPPED}: {', '.join(gone)} left the federation before the last evaluation"] if gone else []
    return "; ".join(parts) + f"; Avg and fairness are over the {n} client{'s' if n != 1 else ''} " + \
        ("with test samples." if not gone else "that were evaluated.")


def _int(v: Any) -> str:
    return "-" if v is None or v == 0 else f"{int(v):,}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def comparison_markdown(results: Sequence[Mapping[str, Any]], title: str = "",
                        clients: Sequence[str] | None = None, note_no_test: bool = True) -> str:
    """Rows = methods, columns = clients/domains + Avg + # of Comm Params (FedPCL Table 2
    layout); cells "mean(std)" over seeds. "# of Comm Params" is the papers' convention
    ("-" where none is published, and for Solo, as printed); the measured upload per client
    per round sits in its own column, never mixed with it."""
    if not results:
        raise UserError("results: nothing to compare")
    cols = list(clients) if clients else sorted({c for r in results for c in r["per_client"]})
    rows = []
    for r in results:
        c, n = r.get("communication", {}), _n_seeds(r)
        rows.append([r["algorithm"]] + [_cell(r["per_client"].get(k), n) for k in cols]
                    + [_cell(r["accuracy"], n), _int(c.get("paper_comm_params_per_client_per_round")),
                       _int(c.get("upload_params_per_client_per_round"))])
    seeds = seeds_phrase(results)
    out = [f"## {title}" + (f", {seeds}" if seeds else ""), ""] if title else []
    out.append(_table(["Method", *cols, "Avg", "# of Comm Params", "Measured upload/client/round"],
                      rows))
    note = _no_test_note(results) if note_no_test else ""
    if note:
        out += ["", note]
    # results.json files written before std_ddof existed used ddof=0
    if all(_n_seeds(r) == 1 for r in results):
        out += ["", f"Cells: {seeds}, so no spread over seeds."]
    else:
        conventions = sorted({metrics.std_convention(int(r.get("std_ddof", 0))) for r in results})
        out += ["", "Cells: " + "; ".join(conventions).replace("over seeds", f"over {seeds}" if seeds else "over seeds")
                + ("; n=1: one seed, no spread" if any(_n_seeds(r) == 1 for r in results) else "") + "."]
    fair = [[r["algorithm"]] + [mean_std_cell(r["fairness"][k], r.get("fairness_std", {}).get(k, 0.0), _n_seeds(r))
                                for k in metrics.FAIRNESS_KEYS] for r in results]
    why = {True: "one pass: every client sends its statistics once",
           False: "its first round only collects statistics"}
    short = [f"{r['algorithm']} trains {r['training_rounds']} of them "
             f"({why[bool(r['one_pass']) if 'one_pass' in r else one_pass(r['algorithm'])]})" for r in results
             if r.get("training_rounds") is not None and r["training_rounds"] < r["rounds"]]
    if short:
        out += ["", f"Rounds: {results[0]['rounds']} communication rounds; " + "; ".join(short) + "."]
    out += ["", "Fairness across clients (FedPCL Tables 12-13; worst/best q% = mean of max(1, floor(q n)) "
            "clients; Variance = std in pp):", "",
            _table(["Method", "Average", "Worst 10%", "Worst 20%", "Worst 40%", "Best 10%",
                    "Variance"], fair)]
    return "\n".join(out) + "\n"


def run_markdown(result: Mapping[str, Any]) -> str:
    """Markdown summary of one run (all seeds)."""
    c, n, seeds = result.get("communication", {}), _n_seeds(result), seeds_phrase([result])
    ran = result.get("training_rounds")
    rounds = (f"one pass ({result['rounds']} rounds asked: later ones would only send zeros)"
              if result.get("one_pass") and ran == 1 and result["rounds"] != 1 else f"{result['rounds']} rounds")
    lines = [f"# {result['algorithm']} on {' + '.join(result['backbones'])}: {rounds}"
             + (f", {seeds}" if seeds else ""), "",
             f"- rounds: {rounds}; seeds: {result['seeds']}",
             f"- accuracy (mean over clients, {'one seed' if n == 1 else 'mean(std) over seeds'}): "
             f"**{_cell(result['accuracy'], n)}**",
             f"- trainable parameters per client: {_int(result.get('trainable_params_per_client'))}"
             f" (paper convention: {_int(result.get('paper_trainable_params_per_client'))})",
             *timing_markdown(result), "",
             "## Per client", "",
             _table(["Client", "Accuracy"], [[k, _cell(v, n)] for k, v in
                                              sorted(result["per_client"].items())]), ""]
    note = _no_test_note([result])
    lines += [note, ""] if note else []
    lines += ["## Communication", "",
             _table(["Quantity", "Value"], [[k, "-" if v is None else f"{v:,.0f}"]
                                            for k, v in c.items() if not isinstance(v, str)]), ""]
    lines += [f"Download: {c['download_note']}.", ""] if c.get("download_note") else []
    lines += [comparison_markdown([result], note_no_test=False).split("\n\n", 1)[1]]
    return "\n".join(lines)


def write_markdown(text: str, path: str | Path) -> Path:
    return _atomic_write(Path(path), lambda fh: fh.write(text))


def write_comparison(results: Sequence[Mapping[str, Any]], out_dir: str | Path,
                     title: str = "Comparison") -> dict[str, Path]:
    """report.md + accuracy_per_round.png + per_client.png in ``out_dir``."""
    out = Path(out_dir)
    return {"markdown": write_markdown(f"# {title}\n\n" + comparison_markdown(results),
                                       out / "report.md"),
            "history_png": plotting.plot_history(results, out / "accuracy_per_round.png"),
            "per_client_png": plotting.plot_per_client(results, out / "per_client.png")}
