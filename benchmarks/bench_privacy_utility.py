"""Privacy-utility curve of FedNCM under differential privacy (fedheads.privacy): accuracy
against the epsilon spent, central and distributed noise, beside the non-private head.

Data: the embedded default (`builtin:digits`, one client per domain, features of
`digitnet-builtin`, as `python -m pipelines.quickstart`), extracted once into --workdir.
For each target epsilon the noise multiplier is calibrated (one release per example: FedNCM
sends each client's statistics once), FedNCM is trained over --seeds seeds (each seed draws its
own noise), and the mean test accuracy over clients is recorded with its std over seeds, with the
epsilon actually spent that results.json reports.

Features are normalised to norm --clip (FedNCM's cosine head does not depend on the norm, so
this costs nothing but fixes the sensitivity); the budget is split equally between sums and
counts unless --split says otherwise.

Usage: python benchmarks/bench_privacy_utility.py [--train-per-class 100 --seeds 5]
       python benchmarks/bench_privacy_utility.py --small   (a smoke run: 10 per class, 2 seeds)
Writes benchmarks/results/privacy_utility.json and .png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from machine_info import write_json  # sibling module (benchmarks/ is on sys.path)

HERE = Path(__file__).resolve().parent


BACKBONE = "digitnet-builtin"


def features(workdir: Path, train_per_class: int, test_per_class: int) -> tuple[Path, str]:
    """(the digits store, its backbone), extracted once per partition size."""
    import embedcache

    store = workdir / f"digits-{train_per_class}-{test_per_class}.zarr"
    if not store.exists():
        man = embedcache.partition("builtin:digits", scheme="feature-shift", train_per_class=train_per_class,
                                   test_per_class=test_per_class)
        embedcache.extract(man, BACKBONE, str(store), progress=False)
    return store, BACKBONE


def run_point(store: Path, backbone: str, seeds: list[int], dp: dict | None) -> dict:
    import fedheads

    t0 = time.perf_counter()
    r = fedheads.train(str(store), "fedncm", backbones=backbone, rounds=1, seeds=seeds,
                       device="cpu", dp=dp).to_dict()
    acc = r["accuracy"]
    out = {"accuracy_mean": acc["mean"], "accuracy_std": acc["std"], "seconds": time.perf_counter() - t0,
           "per_seed": acc.get("per_seed")}
    if dp is not None:
        p = r["privacy"]
        out.update({k: p[k] for k in ("epsilon", "epsilon_all_seeds", "noise_multiplier", "noise_std",
                                      "releases_per_example", "delta", "accountant", "mode")})
    return out


def plot(result: dict, path: Path) -> Path:
    from fedheads.report import plotting

    fig, ax = plotting.pyplot().subplots(figsize=(5.5, 3.8))
    for i, (mode, pts) in enumerate(result["curves"].items()):
        ax.errorbar([p["epsilon"] for p in pts], [p["accuracy_mean"] for p in pts],
                    yerr=[p["accuracy_std"] or 0 for p in pts], marker="o", capsize=3, color=plotting.color(i),
                    label=f"FedNCM, {mode} noise")
    ax.axhline(result["non_private"]["accuracy_mean"], color="k", ls="--", lw=1, label="FedNCM, no DP")
    ax.set_xscale("log")
    ax.set_xlabel(f"epsilon spent (delta = {result['delta']:g}, {result['accountant'].upper()})")
    ax.set_ylabel("test accuracy (%), mean over clients")
    ax.set_title(f"{result['source']}, {result['backbone']}, {result['train_per_class']} train/class/client")
    ax.legend(fontsize=8)
    return plotting.save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-per-class", type=int, default=100)
    ap.add_argument("--test-per-class", type=int, default=20)
    ap.add_argument("--epsilons", default="0.1,0.3,1,3,10,30")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--transform", default="normalize", choices=["clip", "normalize"])
    ap.add_argument("--accountant", default="pld", choices=["rdp", "pld"])
    ap.add_argument("--modes", default="central,distributed")
    ap.add_argument("--split", default="", help="e.g. sums=0.9,counts=0.1 (default: equal)")
    ap.add_argument("--small", action="store_true", help="smoke run: 10 train per class, 2 seeds, 3 epsilons")
    ap.add_argument("--workdir", default=None, help="where the store is extracted (default: a temporary directory)")
    ap.add_argument("--out", default=str(HERE / "results" / "privacy_utility.json"))
    a = ap.parse_args(argv)
    if a.small:
        a.train_per_class, a.seeds, a.epsilons = 10, 2, "0.3,3,30"
    split = [(k, float(v)) for k, _, v in (i.partition("=") for i in a.split.split(",") if i.strip())]
    seeds = list(range(a.seeds))
    with tempfile.TemporaryDirectory() as tmp:
        store, backbone = features(Path(a.workdir or tmp), a.train_per_class, a.test_per_class)
        result: dict = {"benchmark": "privacy_utility", "algorithm": "fedncm", "source": "builtin:digits",
                        "backbone": backbone, "train_per_class": a.train_per_class,
                        "test_per_class": a.test_per_class, "seeds": seeds, "delta": a.delta, "clip": a.clip,
                        "transform": a.transform, "accountant": a.accountant, "split": dict(split),
                        "non_private": run_point(store, backbone, seeds, None), "curves": {}}
        for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
            pts = []
            for eps in [float(e) for e in a.epsilons.split(",")]:
                dp = {"epsilon": eps, "delta": a.delta, "clip": a.clip, "transform": a.transform,
                      "accountant": a.accountant, "mode": mode, "split": tuple(split), "noise_seed": 0}
                p = run_point(store, backbone, seeds, dp)
                p["target_epsilon"] = eps
                pts.append(p)
                print(f"{mode:11s} eps {eps:6g} (spent {p['epsilon']:.4g}, z {p['noise_multiplier']:.3g}): "
                      f"{p['accuracy_mean']:.2f} +- {p['accuracy_std'] or 0:.2f}", file=sys.stderr)
            result["curves"][mode] = pts
    out = Path(a.out)
    write_json(result, out)
    plot(result, out.with_suffix(".png"))
    print(f"non-private {result['non_private']['accuracy_mean']:.2f}; wrote {out} and {out.with_suffix('.png')}",
          file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
