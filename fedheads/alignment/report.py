"""FedDRA results: the per-seed entries for fedheads.report.results.summarise_runs, the FedDRA blocks of
results.json (retrieval, worst client, disparity, lambda, communication per stage, compute), the
Markdown summary and the plots (retrieval per round, retrieval per client, lambda over rounds)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedheads.alignment.evaluation import METRICS, across_clients
from fedheads.finetuning.rounds import seed_timing
from fedheads.report import plotting
from fedheads.report import results as report
from fedheads.run.rundir import RunDir, jsonable

HEADLINE = ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5", "cap_t2i_r1", "cap_t2i_r5")


def _ms(vals: Sequence[float]) -> dict[str, float]:
    v = [x for x in vals if x == x]
    if not v:
        return {"mean": math.nan, "std": math.nan}
    return {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0}


def _final(run: Any) -> Any:
    return next(r for r in reversed(run.rounds) if r.retrieval is not None)


def seed_result(run: Any, net: Any, clients: Sequence[Any], seed: int) -> dict[str, Any]:
    """One seed for summarise_runs: per_client = text->image R@1 (%) of the last evaluation."""
    fin = _final(run).retrieval
    per_client = {c.name: 100.0 * fin[c.index]["t2i_r1"] for c in clients if fin[c.index]["t2i_r1"] == fin[c.index]["t2i_r1"]}
    history = [{"round": r.round, "accuracy": 100.0 * across_clients(r.retrieval)["mean"]}
               for r in run.rounds if r.retrieval]
    trained = run.rounds[1:]
    up = sum(s["up_bytes"] for r in trained for s in r.comm.values())
    down = sum(s["down_bytes"] for r in trained for s in r.comm.values())
    up_v = sum(s["up_values"] for r in trained for s in r.comm.values())
    msgs = len(clients) * max(1, len(trained))
    state = net.state(2)
    return {"seed": seed, "per_client": per_client, "history": history,
            "clients_without_test": [c.name for c in clients if c.test.n == 0],
            "n_test": {c.name: c.test.n for c in clients},
            "communication": {"upload_params_per_client_per_round": up_v / msgs, "upload_bytes_total": up,
                              "download_bytes_total": down},
            "trainable_params_per_client": int(sum(state[k].numel() for k in net.parameter_keys(2)))}


def _probe_summary(probes: Sequence[Any]) -> dict[str, Any] | None:
    probes = [p for p in probes if p]
    if not probes:
        return None
    out: dict[str, Any] = {k: probes[0][k] for k in ("manifest_hash", "n_train", "n_test", "shots", "draws")}
    for feat in ("z", "pooled", "backbone"):
        if feat not in probes[0]:
            continue
        if "skipped" in probes[0][feat]:
            out[feat] = probes[0][feat]
            continue
        out[feat] = {k: _ms([p[feat][k]["mean"] for p in probes]) for k in probes[0][feat]}
    out["per_seed"] = list(probes)
    return out


def extra(runs: Sequence[Any], per_seed: Sequence[Mapping[str, Any]], cfg: Any, su: Any, opts: Any,
          probes: Sequence[Any], exported: Sequence[Any]) -> dict[str, Any]:
    """The FedDRA blocks of results.json (docs/contracts.md section 10)."""

    names = [c.name for c in su.clients]
    finals = [_final(r).retrieval for r in runs]
    retrieval = {}
    for m in METRICS:
        client_means = [across_clients(f, m) for f in finals]
        retrieval[m] = {"mean": _ms([100 * x["mean"] for x in client_means]),
                        "worst": _ms([100 * x["worst"] for x in client_means]),
                        "per_client": {n: _ms([100 * f[i][m] for f in finals]) for i, n in enumerate(names)}}
    per_round = []
    for rr in zip(*(r.rounds for r in runs)):
        if rr[0].retrieval is None:
            continue
        row: dict[str, Any] = {"round": rr[0].round}
        for m in HEADLINE:
            stats = [across_clients(r.retrieval, m) for r in rr]
            row[m] = _ms([100 * s["mean"] for s in stats])["mean"]
            row[f"{m}_worst"] = _ms([100 * s["worst"] for s in stats])["mean"]
        per_round.append(row)
    stages: dict[str, dict[str, float]] = {}
    for key in ("stage1", "stage2"):
        vals = [[r.comm[key] for r in run.rounds[1:] if key in r.comm] for run in runs]
        if any(vals):
            stages[key] = {f: float(np.mean([sum(x[f] for x in v) for v in vals]))
                           for f in ("up_values", "up_bytes", "down_values", "down_bytes")}
            stages[key]["rounds"] = len(vals[0])
    lam_final = np.mean([r.rounds[-1].lam for r in runs], axis=0).tolist()
    return {
        "method": "feddra", "config": jsonable(cfg), "plan": [list(p) for p in cfg.plan()],
        "dataset": su.manifest.source, "image_encoder": su.image_bb.name, "text_encoder": su.text_bb.name,
        "image_cut": su.cut,
        "image_trainable": opts.image_trainable, "text_trainable": opts.text_trainable if su.needs_text else "frozen",
        "bn": opts.bn, "clients": names, "domains": [c.domain for c in su.clients], "training_rounds": cfg.rounds,
        "eval_batch": 64, "chance": {"r1": retrieval["chance_r1"]["mean"]["mean"],  # percent
                                     "r5": retrieval["chance_r5"]["mean"]["mean"]},
        "retrieval": retrieval, "retrieval_history": per_round,
        "worst_client": {m: retrieval[m]["worst"] for m in ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5")},
        "disparity": _ms([100 * across_clients(f)["disparity"] for f in finals]),
        "lambda": {"clients": names, "final_mean": lam_final,
                   "per_seed": {str(s["seed"]): [r.lam for r in run.rounds] for s, run in zip(per_seed, runs)}},
        "v": {str(s["seed"]): [r.v for r in run.rounds[1:]] for s, run in zip(per_seed, runs)},
        "step_scale": {str(s["seed"]): [r.scale for r in run.rounds[1:]] for s, run in zip(per_seed, runs)},
        "communication_per_stage": stages,
        "compute": {"F_total": float(np.mean([sum(r.compute_F for r in run.rounds) for run in runs])),
                    "reencoded_samples": float(np.mean([sum(r.reencoded for r in run.rounds) for run in runs])),
                    "unit": "F = one forward pass of both encoders on one pair; stage 2: 3F per trained pair "
                            "(+1F anchor when mu > 0); stage 1 from the cache: 0F (alignment modules not "
                            "counted); live stage 1, re-encoding and live v batches: 1F per pair"},
        "probe": _probe_summary(probes), "encoders": list(exported),
        "timing": {"per_seed": [seed_timing(s["seed"], run) for s, run in zip(per_seed, runs)],
                   "load_wall_seconds": None, "load_cpu_seconds": None},
    }


# ------------------------------------------------------------------ Markdown and plots
def _cell(d: Mapping[str, float] | None) -> str:
    if not d or d.get("mean") is None or d["mean"] != d["mean"]:
        return "-"
    return f"{d['mean']:.2f}({d['std']:.2f})"


def _probe_cells(r: Mapping[str, Any]) -> list[str]:
    p = r.get("probe") or {}
    cells = []
    for feat in ("z", "pooled", "backbone"):
        f = p.get(feat)
        if not f:
            cells.append("-")
        elif "skipped" in f:
            cells.append("needs ckpt:")
        else:
            cells.append(" / ".join(_cell(f[k]) for k in sorted(f, key=int)))
    return cells


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """Rows = methods; Table 2's Rec./Wst. columns plus image->text, caption level and the probe."""
    rows = []
    for r in results:
        ret = r["retrieval"]
        rows.append([r["algorithm"], _cell(ret["t2i_r1"]["mean"]), _cell(ret["t2i_r5"]["mean"]),
                     _cell(ret["t2i_r1"]["worst"]), _cell(ret["t2i_r5"]["worst"]), _cell(r["disparity"]),
                     _cell(ret["i2t_r1"]["mean"]), _cell(ret["cap_t2i_r1"]["mean"]),
                     " ".join(f"{x:.3f}" for x in r["lambda"]["final_mean"]), *_probe_cells(r)])
    shots = next((r["probe"]["shots"] for r in results if r.get("probe")), None)
    k = "/".join(map(str, shots)) + "-shot" if shots else "k-shot"
    head = ["Method", "Rec.@1", "Rec.@5", "Wst.@1", "Wst.@5", "Disparity", "I->T @1", "Caption @1",
            "final lambda", f"probe z {k}", f"probe pooled {k}", f"probe backbone {k}"]
    r0 = results[0]
    notes = (f"Text->image retrieval (%) in fixed seeded batches of {r0['eval_batch']} (chance R@1 "
             f"{r0['chance']['r1']:.2f}, R@5 {r0['chance']['r5']:.2f}; class-only baseline R@1 "
             f"{r0['retrieval']['class_r1']['mean']['mean']:.2f}, R@5 {r0['retrieval']['class_r5']['mean']['mean']:.2f}); "
             "Rec. = mean over clients, Wst. = worst client, Disparity = max - min client R@1; "
             "cells mean(std) over seeds; probe = linear-probe accuracy (%).")
    return report._table(head, rows) + "\n\n" + notes + "\n"


def run_markdown(r: Mapping[str, Any]) -> str:
    lines = [f"# {r['algorithm']}: {r['image_encoder']} @ {r['image_cut']} + {r['text_encoder']}", "",
             f"- rounds {r['rounds']} ({r['config']['schedule']}, two-stage {r['config']['two_stage']}), "
             f"{r['config']['steps']} steps per stage, batch {r['config']['batch_size']}; seeds {r['seeds']}",
             f"- mu {r['config']['mu']}, rho {r['config']['dro']['rho']} ({r['config']['dro']['divergence']}, "
             f"radius {r['config']['dro']['radius_convention']}), prox_mu {r['config']['prox_mu']}",
             *report.timing_markdown(r), "", "## Retrieval", "", table([r]), "## Per client", "",
             report._table(["Client", "T->I R@1", "T->I R@5", "I->T R@1", "final lambda"],
                           [[c, _cell(r["retrieval"]["t2i_r1"]["per_client"][c]),
                             _cell(r["retrieval"]["t2i_r5"]["per_client"][c]),
                             _cell(r["retrieval"]["i2t_r1"]["per_client"][c]), f"{lam:.3f}"]
                            for c, lam in zip(r["clients"], r["lambda"]["final_mean"])]), "",
             "## Stages", ""]
    st = r["communication_per_stage"]
    lines.append(report._table(["stage", "rounds", "upload (MB)", "download (MB)"],
                               [[k, str(v["rounds"]), f"{v['up_bytes'] / 1e6:.3f}", f"{v['down_bytes'] / 1e6:.3f}"]
                                for k, v in st.items()]))
    lines += ["", f"Compute: {r['compute']['F_total']:.4g} F ({r['compute']['unit']}); "
              f"re-encoded samples: {r['compute']['reencoded_samples']:.0f}.", ""]
    if r.get("probe"):
        skipped = [f"{k}: {v['skipped']}" for k, v in r["probe"].items() if isinstance(v, dict) and "skipped" in v]
        lines += ["Probe: " + "; ".join(skipped), ""] if skipped else []
    lines += ["![retrieval per round](retrieval_per_round.png)", "![retrieval per client](retrieval_per_client.png)",
              "![lambda](lambda.png)", ""]
    return "\n".join(lines)


def _title(what: str, results: Sequence[Mapping[str, Any]]) -> str:
    r = results[0]
    return plotting.title(what, r.get("dataset"), f"{r['image_encoder']} + {r['text_encoder']}")


def plot_rounds(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(results):
        h = r["retrieval_history"]
        x = [p["round"] for p in h]
        ax.plot(x, [p["t2i_r1"] for p in h], marker="o" if len(x) < 12 else None, label=f"{r['algorithm']} mean",
                color=plotting.color(i))
        ax.plot(x, [p["t2i_r1_worst"] for p in h], ls="--", color=plotting.color(i),
                label=f"{r['algorithm']} worst client")
    ax.axhline(results[0]["chance"]["r1"], color="0.5", lw=0.8, ls=":", label="chance")
    ax.set_xlabel("round")
    ax.set_ylabel("text->image R@1 (%)")
    ax.set_title(_title("Retrieval per round", results), fontsize=10)
    ax.grid(alpha=0.3)
    plotting.legend_outside(ax)
    return plotting.save(fig, path)


def plot_clients(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = plotting.pyplot()
    clients = results[0]["clients"]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(clients) * len(results)), 4), sharey=False)
    w = 0.8 / len(results)
    x = np.arange(len(clients))
    for ax, m in zip(axes, ("t2i_r1", "t2i_r5")):
        for j, r in enumerate(results):
            pc = r["retrieval"][m]["per_client"]
            ax.bar(x + (j - (len(results) - 1) / 2) * w, [pc[c]["mean"] for c in clients], w,
                   yerr=[0 if pc[c]["std"] != pc[c]["std"] else pc[c]["std"] for c in clients], capsize=2,
                   label=r["algorithm"], color=plotting.color(j))
        step = plotting.client_label_step(len(clients), fig.get_figwidth() / 2 * 0.8, 8)
        ax.set_xticks(x[::step], clients[::step], rotation=30 if len(clients) <= 12 else 90, fontsize=8)
        ax.set_title(f"text->image R@{m[-1]} (%) per client")
        ax.axhline(results[0]["chance"][f"r{m[-1]}"], color="0.5", lw=0.8, ls=":")
    fig.suptitle(_title("Retrieval per client", results), fontsize=10)
    plotting.legend_outside(axes[1], source=axes[0])
    return plotting.save(fig, path)


def plot_lambda(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        per_seed = list(r["lambda"]["per_seed"].values())
        lam = np.mean(np.array(per_seed, dtype=float), axis=0)  # [rounds + 1, N]
        for i, c in enumerate(r["clients"]):
            ax.plot(np.arange(lam.shape[0]), lam[:, i], label=c, **plotting.style(i))
        ax.axhline(1 / len(r["clients"]), color="0.5", lw=0.8, ls=":")
        ax.set_title(f"{r['algorithm']}: lambda (mean over seeds)")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    fig.suptitle(_title("DRO client weights", results), fontsize=10)
    plotting.legend_outside(axes[0][-1], ncol=1 if len(results[0]["clients"]) <= 20 else 2)
    return plotting.save(fig, path)


def _plots(results: Sequence[Mapping[str, Any]], rd: RunDir) -> None:
    rd.save_figure("retrieval_per_round.png", lambda p: plot_rounds(results, p))
    rd.save_figure("retrieval_per_client.png", lambda p: plot_clients(results, p))
    rd.save_figure("lambda.png", lambda p: plot_lambda(results, p))


def write_run(result: Mapping[str, Any], rd: RunDir) -> None:
    """The plots and summary.md of one method's run directory (results.json: the caller, last)."""
    _plots([result], rd)
    rd.write_text("summary.md", run_markdown(result))


def write_comparison(results: Sequence[Mapping[str, Any]], rd: RunDir) -> None:
    """The plots and summary.md of a comparison of methods (results.json: the caller, last)."""
    _plots(results, rd)
    r0 = results[0]
    md = (f"# FedDRA and baselines: {r0['image_encoder']} @ {r0['image_cut']} + {r0['text_encoder']}\n\n"
          f"{r0['rounds']} rounds, seeds {r0['seeds']}\n\n{table(results)}\n"
          "![retrieval per round](retrieval_per_round.png)\n![retrieval per client](retrieval_per_client.png)\n"
          "![lambda](lambda.png)\n")
    rd.write_text("summary.md", md)
