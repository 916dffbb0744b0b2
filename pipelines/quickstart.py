"""The main job on the embedded default: partition -> extract -> fedheads compare.

    python -m pipelines.quickstart [--out runs/quickstart] [--rounds 30] [--seeds 0,1,2]

Works offline with nothing but `pip install`: the data is `builtin:digits` (real digits that
pip-installed packages ship, plus MNIST-M- and SynthDigits-style domains derived from them), and
the backbone is `resnet20-cifar10` when its published weights are found (a weights directory,
$EMBEDCACHE_WEIGHTS, ../shared/weights, the cache) or else `digitnet-builtin`, a small CNN this
project pre-trained itself on synthetic digits disjoint from the clients (its weights ship with the
package: no run pre-trains).
Every stage is the public CLI, run as a subprocess, so this file is also a worked example.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

ALGORITHMS = "fedpcl,fedncm,lp,mlp,fedavg,fedproto"  # every one at its defaults


def _pasteable(module: str) -> list[str]:
    """How a user runs `module` as pasted: the console script beside this Python (its venv's
    bin/, relative to the current folder when inside it), so that the command runs without
    activating the venv; `python -m` where no script is installed."""
    script = Path(sys.executable).parent / {"embedcache.cli": "embedcache", "fedheads.cli": "fedheads"}[module]
    show = lambda p: os.path.relpath(p) if Path(p).absolute().is_relative_to(Path.cwd()) else str(p)  # noqa: E731
    return [show(script)] if script.is_file() else [show(sys.executable), "-m", module]


def _run(args: list[str]) -> None:
    # echo what a user would type: the venv's console scripts, not the modules run here
    click.secho("$ " + shlex.join([*_pasteable(args[0]), *args[1:]]), fg="cyan", err=True)  # quoted: one command
    proc = subprocess.run([sys.executable, "-m", *args])
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)


@click.command()
@click.option("--out", default="runs/quickstart", show_default=True, type=click.Path(file_okay=False))
@click.option("--rounds", default=30, show_default=True, help="Federated rounds per algorithm.")
@click.option("--seeds", default="0,1,2", show_default=True, help="Comma-separated seeds.")
@click.option("--train-per-class", default=10, show_default=True, help="FedPCL Table 8: 10.")
@click.option("--test-per-class", default=100, show_default=True,
              help="Test images per class and client (0: the rest of each domain).")
@click.option("--backbones", default=None, help="Override the default backbone choice.")
@click.option("--ft-rounds", default=5, show_default=True,
              help="Fine-tuning rounds of the FedNCM+FT vs FT comparison (0: skip it).")
def main(out: str, rounds: int, seeds: str, train_per_class: int, test_per_class: int,
         backbones: str | None, ft_rounds: int) -> None:
    """Run the embedded-default comparison and print the table."""
    from embedcache.backbones import default_backbones_with_reason

    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if backbones is None:
        names, reason = default_backbones_with_reason()
        backbones = ",".join(names)
        click.secho(f"backbone: {backbones}; {reason}", fg="green", err=True)
    manifest = outdir / "manifest.json"
    store = outdir / "store.zarr"
    _run(["embedcache.cli", "partition", "builtin:digits", "--scheme", "feature-shift",
          "--train-per-class", str(train_per_class),
          *(["--test-per-class", str(test_per_class)] if test_per_class else []),
          "--seed", "0", "--out", str(manifest)])
    _run(["embedcache.cli", "extract", "--manifest", str(manifest), "--backbones", backbones,
          "--store", str(store)])
    _run(["fedheads.cli", "compare", "--store", str(store), "--backbones", backbones,
          "--algorithms", ALGORITHMS, "--rounds", str(rounds), "--seeds", seeds,
          "--overwrite", "--out", str(outdir / "compare")])  # a re-run replaces its own report
    results = json.loads((outdir / "compare" / "results.json").read_text())
    # `fedheads compare` printed the table and its report path: only the time is new here
    click.secho(f"{len(results['algorithms'])} head algorithms in {time.perf_counter() - t0:.0f} s", fg="green",
                err=True)
    reports = [outdir / "compare" / "summary.md"]
    if ft_rounds > 0 and _finetune(backbones.split(",")[0], manifest, store, outdir, ft_rounds):
        reports.append(outdir / "finetune" / "summary.md")
    click.secho(f"done in {time.perf_counter() - t0:.0f} s; reports: {', '.join(map(str, reports))}", fg="green",
                err=True)


def _finetune(backbone: str, manifest: Path, store: Path, outdir: Path, rounds: int) -> bool:
    """FedNCM+FT vs FT (FedNCM paper, Sec. 4.2), cache-first: the frozen prefix up to the last cut
    but one comes from the store as activation maps, the last stage and the head train."""
    from embedcache.backbones import list_backbones

    cuts = next((r.cut_points for r in list_backbones() if r.name == backbone), ()) or ()
    if len(cuts) < 2:
        click.secho(f"fine-tuning skipped: {backbone} has no cut points to train from the cache", err=True)
        return False
    cut = cuts[-2]
    _run(["embedcache.cli", "extract", "--manifest", str(manifest), "--backbones", backbone, "--cut", cut,
          "--store", str(store)])
    _run(["fedheads.cli", "finetune", "--manifest", str(manifest), "--store", str(store), "--backbone", backbone,
          "--head", "fedncm,random", "--rounds", str(rounds), "--set", f"trainable=after:{cut}", "--overwrite",
          "--out", str(outdir / "finetune")])
    done = outdir / "finetune" / "results.json"
    for line in ft_story(json.loads(done.read_text()), rounds) if done.is_file() else []:
        click.secho(line, err=True)
    return True


def ft_story(res: dict, rounds: int) -> list[str]:
    """What the fine-tuning comparison shows, in words: the FedNCM paper's claim (Sec. 4.2: FedNCM+FT
    above FT from a random head) checked, and, where fine-tuning ends below its own round-0 head,
    why (the data is small)."""
    algs = res.get("algorithms", {})
    ncm, ft = algs.get("fedncm+ft"), algs.get("random+ft") or algs.get("ft")
    if not ncm or not ft:
        return []
    a, b, start = ncm["accuracy"]["mean"], ft["accuracy"]["mean"], ncm["figure1"][0]["accuracy"]
    out = [f"FedNCM+FT {a:.2f} vs FT {b:.2f} after {rounds} rounds: the FedNCM paper's claim (FedNCM+FT above FT "
           f"from a random head, Sec. 4.2) {'holds' if a > b else 'does not hold'} here"]
    if a < start:
        out.append(f"FedNCM+FT ends {start - a:.2f} points below its round-0 head ({start:.2f}): with 10 training "
                   "images per class, fine-tuning the last stage over-fits them within these rounds; on more data "
                   "the head is the better start and fine-tuning adds to it (docs/benchmarks.md, fine-tuning)")
    return out


if __name__ == "__main__":
    main()
