"""The same FedAvg protocols on the same cached features in fedheads and its peers
(pfl-research, Flower, FedLab), side by side, and fedheads' distance to the machine's bound.

Protocols (clients, per round, rounds; batch 10, one local epoch, client SGD, 10 classes):
  lr_mnist    FLUTE's LR_MNIST: 1,000 clients of 60 Fashion-MNIST training images (784 pixels
              in [0, 1]), 10 per round, 100 rounds, a linear softmax head;
  crossdevice pfl-research's cross-device setting on a frozen backbone: 1,000 clients of 60
              rows of 1280-d features, 50 per round, a linear head and an MLP (one hidden layer
              of 256, ReLU);
  skewed      crossdevice with client sizes drawn (seeded, with replacement) from
              iNaturalist-Users-120K's shape (../shared/data/federation_shapes), 100 per round.
Data: Fashion-MNIST from --fashion-mnist (the Debian package dataset-fashion-mnist's folder,
raw or .gz IDX files); 1280-d features from an embedcache store (--store, --backbone: e.g. the
EfficientNet-Lite0 features of the same images, every client's rows pooled) or an .npz
(--features: x_train, y_train, x_test, y_test); where either is absent,
synthetic Gaussian class clusters of the same shape (the JSON says which). Training rows are
dealt to clients at random (seeded), each client's rows in a random order.

Method: every framework gets the same features, initial head (fedheads' init), client lists
per round (fedheads' seeded sampler), learning rate, batch size and epochs
(peers_frameworks.py says how each framework is driven); no framework keeps a client's local
model between rounds (fedheads: FedAvg's local_models=False). Each (case, framework) runs
--repeats times in a fresh interpreter, frameworks interleaved and their order alternated
between repeats; a run's wall and CPU seconds are timed inside it from the features in memory
to the last global model (setup included, imports and file reading not), its peak RSS is the
interpreter's VmHWM, its whole-process CPU comes from os.wait4. The global model after each
tenth of the rounds is kept and tested here on the central test set, the same code for every
framework. Reported per case and framework: median, min, max of those; rounds per second; the
accuracy curve; the time ratio to fedheads (vectorised); agreement (final accuracy within 1
point of fedheads'); the largest difference of a final parameter from fedheads'. Client SGD's
learning rate is --lr (0.05, chosen here, not taken from FLUTE's configuration).
The bound per round, per case: max(FLOPs / GEMM rate, feature bytes / memory bandwidth), the
FLOPs of forward and backward over the round's samples (linear 4DC per sample; MLP 4DH + 6HC),
the GEMM rate of torch.matmul at one local step's stacked shapes ([k, B, D] x [k, D, out] and
the weight-gradient product) and the bandwidth of a 256 MiB tensor copy (read + write), all on
--threads threads; fedheads' median training round (updates + aggregation) as a multiple of
it, and its whole run per round (setup and the final evaluation included) as another; and a
cProfile of one fedheads run (the top functions by own time; fedheads' by cumulative time).

Usage: python benchmarks/bench_peers.py [--protocols lr_mnist,crossdevice,skewed] [--repeats 3]
           [--frameworks fedheads,fedheads-loop,pfl,flower,fedlab] [--fashion-mnist DIR]
           [--store STORE --backbone NAME | --features NPZ] [--site DIR] [--quick] [--out PATH]
Peers are installed apart from the project (benchmarks/requirements-peers.txt, into --site);
one that does not import is listed with the reason. Writes benchmarks/results/peers.json and,
beside it, peers.md (the table) and peers.png (the plot)."""

from __future__ import annotations

import argparse
import cProfile
import csv
import gzip
import json
import math
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from assets import data_dir  # sibling modules (benchmarks/ is on sys.path)
from machine_info import child_env, machine, shown, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
FRAMEWORKS = ("fedheads", "fedheads-loop", "pfl", "flower", "fedlab")
IMPORT = {"pfl": "pfl.version", "flower": "flwr", "fedlab": "fedlab"}  # module whose __version__ is recorded
# peers the issue names that cannot run beside the project: framework -> (the check, the one-line reason)
UNRUNNABLE = {"blazefl": (lambda: sys.version_info >= (3, 12),
                          "every BlazeFL release on PyPI requires Python >= 3.12 (3.0: >= 3.14); the project runs on "
                          f"Python {sys.version_info.major}.{sys.version_info.minor}, and its torch wheels are for it")}
PROTOCOLS = {  # clients, per round, rounds, feature dim, heads, client sizes
    "lr_mnist": dict(clients=1000, per_round=10, rounds=100, dim=784, heads=("linear",), sizes="equal"),
    "crossdevice": dict(clients=1000, per_round=50, rounds=100, dim=1280, heads=("linear", "mlp"), sizes="equal"),
    "skewed": dict(clients=1000, per_round=100, rounds=100, dim=1280, heads=("linear", "mlp"), sizes="inat"),
}
QUICK = dict(clients=50, per_round=5, rounds=3, test=2000)
HIDDEN, EPOCHS, CLASSES = 256, 1, 10  # CLASSES: of the synthetic features (real data: its labels)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format), raw or gzipped."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist(folder: Path) -> tuple[np.ndarray, ...] | None:
    """(x_train [60000, 784] in [0, 1], y_train, x_test, y_test), or None without the files."""
    def find(stem: str) -> Path | None:
        return next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)

    paths = [find(s) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                               "t10k-labels-idx1-ubyte")]
    if any(p is None for p in paths):
        return None
    xtr, ytr, xte, yte = (read_idx(p) for p in paths)  # type: ignore[arg-type]
    flat = lambda a: (a.reshape(len(a), -1).astype(np.float32) / 255.0)  # noqa: E731
    return flat(xtr), ytr.astype(np.int64), flat(xte), yte.astype(np.int64)


def synthetic(dim: int, n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, ...]:
    """Gaussian class clusters (centres N(0, 0.05^2) per coordinate, unit noise): a linear head
    reaches roughly 80-90 % at 784-1280 dimensions, not 100 %."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=0.05, size=(CLASSES, dim)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, CLASSES, n)
        return centres[y] + rng.standard_normal((n, dim), dtype=np.float32), y.astype(np.int64)

    return (*draw(n_train), *draw(n_test))


def store_features(store: str, backbone: str) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) of an embedcache store: every client's rows of `backbone`
    pooled (the benchmark deals them to its own clients)."""
    from embedcache.store.reader import iter_split_chunks, open_store

    info = open_store(store, quiet=True)
    out: list[np.ndarray] = []
    for split in ("train", "test"):
        parts = [(x, y) for c in info.clients for x, y, _ in iter_split_chunks(info, [backbone], split, c)]
        out += [np.concatenate([x for x, _ in parts]).astype(np.float32), np.concatenate([y for _, y in parts]).astype(np.int64)]
    return tuple(out)


def client_sizes(kind: str, clients: int, seed: int) -> np.ndarray:
    if kind == "equal":
        return np.full(clients, 60)
    with open(data_dir("federation_shapes") / "inaturalist_user_120k.csv") as f:
        shape = np.array([int(r["train_images"]) for r in csv.DictReader(f)])
    return np.random.default_rng(seed).choice(shape, size=clients, replace=True)


def schedule(clients: int, per_round: int, rounds: int, seed: int) -> np.ndarray:
    """[rounds, per_round] client ids: fedheads' own seeded sampler, which every peer is given."""
    from fedheads.core.engine import select_participants

    frac = per_round / clients
    return np.stack([select_participants(clients, frac, seed, r).numpy() for r in range(rounds)])


def initial_head(dim: int, hidden: int, classes: int, seed: int) -> dict[str, np.ndarray]:
    from fedheads.core.heads import HeadSpec, init_global

    p, _ = init_global(HeadSpec(dim, hidden, classes, batch_norm=False, normalize=False), seed, "cpu")
    return {k: v.numpy() for k, v in p.items()}


def write_case(folder: Path, data: tuple[np.ndarray, ...], proto: dict, hidden: int, lr: float, batch: int,
               threads: int, seed: int) -> dict:
    """case.npz / case.json for peers_frameworks.py; returns facts about the federation."""
    xtr, ytr = data[0], data[1]
    classes = int(max(ytr.max(), data[3].max())) + 1
    sizes = client_sizes(proto["sizes"], proto["clients"], seed)
    batch = min(batch, int(sizes.max()))  # a larger batch is the same schedule, and fedheads pads batches to it
    rng = np.random.default_rng(seed)
    rows = rng.permutation(len(ytr))
    if sizes.sum() > len(rows):  # more rows than the pool: draw with replacement
        rows = rng.integers(0, len(ytr), int(sizes.sum()))
    rows = rows[:int(sizes.sum())]
    sched = schedule(proto["clients"], proto["per_round"], proto["rounds"], seed)
    R = proto["rounds"]
    keep = sorted({max(1, math.ceil(R * t / 10)) for t in range(1, 11)})
    init = {f"init/{k}": v for k, v in initial_head(xtr.shape[1], hidden, classes, seed).items()}
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "case.npz", x_train=np.ascontiguousarray(xtr[rows]), y_train=ytr[rows],
             offsets=np.concatenate([[0], np.cumsum(sizes)]), schedule=sched, **init)
    (folder / "case.json").write_text(json.dumps({"classes": classes, "hidden": hidden, "lr": lr, "batch": batch,
                                                  "epochs": EPOCHS, "threads": threads, "seed": seed, "keep_rounds": keep}))
    per_round = [int(sizes[s].sum()) for s in sched]
    return {"clients": proto["clients"], "per_round": proto["per_round"], "rounds": R, "dim": int(xtr.shape[1]),
            "batch": batch, "classes": classes,
            "hidden": hidden, "train_rows": int(sizes.sum()), "client_rows_min": int(sizes.min()),
            "client_rows_max": int(sizes.max()), "samples_per_round_mean": float(np.mean(per_round)), "keep_rounds": keep}


def peer_status(env: dict) -> dict:
    """framework -> {"version": ...} or {"missing": one line}: can its fresh interpreter import it?"""
    out = {"fedheads": {"version": "this checkout"}, "fedheads-loop": {"version": "this checkout"}}
    for fw, mod in IMPORT.items():
        p = subprocess.run([sys.executable, "-c", f"import {mod} as m; print(getattr(m, '__version__', '?'))"], env=env,
                           capture_output=True, text=True, timeout=300)
        last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        out[fw] = {"version": p.stdout.strip()} if p.returncode == 0 else {"missing": last}
    for fw, (runs_here, reason) in UNRUNNABLE.items():
        out[fw] = {"missing": reason if not runs_here() else "its Python allows it, but no protocol is written for it here"}
    return out


def run_child(case_dir: Path, fw: str, out: Path, env: dict) -> dict:
    """One run in a fresh interpreter: its own timing and peak RSS, plus its whole CPU time from os.wait4."""
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(HERE / "peers_frameworks.py"), str(case_dir), fw, str(out)],
                             env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if p.returncode != 0:
        raise RuntimeError(f"{fw} failed (exit {p.returncode}):\n{text[-3000:]}")
    r = json.loads(next(ln for ln in text.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    r.update(process_wall_seconds=time.perf_counter() - t0, process_cpu_seconds=ru.ru_utime + ru.ru_stime)
    return r


def accuracy(params: dict[str, np.ndarray], x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy (%) of a head in fedheads' naming (weights [Din, Dout])."""
    t = {k: torch.from_numpy(v) for k, v in params.items()}
    h = torch.relu(x @ t["proj.weight"] + t["proj.bias"]) if "proj.weight" in t else x
    return float(((h @ t["cls.weight"] + t["cls.bias"]).argmax(1) == y).double().mean() * 100)


def kept_models(path: Path) -> dict[int, dict[str, np.ndarray]]:
    z = np.load(path)
    out: dict[int, dict[str, np.ndarray]] = {}
    for k in z.files:
        r, name = k.split("/", 1)
        out.setdefault(int(r), {})[name] = z[k]
    return out


def timed(fn, reps: int = 5) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def bound(facts: dict, threads: int) -> dict:
    """The machine's lower bound per round (module docstring) for one case."""
    torch.set_num_threads(threads)
    D, H, k, n, B = facts["dim"], facts["hidden"], facts["per_round"], facts["samples_per_round_mean"], facts["batch"]
    C = facts["classes"]
    flops = n * EPOCHS * (4 * D * H + 6 * H * C if H else 4 * D * C)
    out = H or C
    a, w, g = torch.randn(k, B, D), torch.randn(k, D, out), torch.randn(k, B, out)
    step_flops = 2 * 2 * k * B * D * out  # forward product + weight-gradient product
    t_step = timed(lambda: (torch.matmul(a, w), torch.matmul(a.transpose(1, 2), g)), 20)
    rate = step_flops / t_step
    big = torch.empty(64 << 20)  # 256 MiB of float32
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / timed(lambda: dst.copy_(big), 5)
    feat = n * EPOCHS * D * 4
    sec = max(flops / rate, feat / bw)
    return {"flops_per_round": flops, "gemm_flops_per_second": rate, "gemm_shapes": f"[{k},{B},{D}]x[{k},{D},{out}]",
            "feature_bytes_per_round": feat, "copy_bytes_per_second": bw, "compute_seconds": flops / rate,
            "memory_seconds": feat / bw, "bound_seconds_per_round": sec}


def profile_fedheads(case_dir: Path, threads: int, top: int = 12) -> dict:
    """cProfile of one fedheads (vectorised) run of the case in this process: the top functions
    by own time (which torch kernels), and fedheads' own functions by cumulative time (which
    stage: stacking the data, local training, aggregation, the final evaluation)."""
    import peers_frameworks as pf

    torch.set_num_threads(threads)
    case = pf.Case(case_dir)
    prof = cProfile.Profile()
    prof.runcall(pf.run_fedheads, case, "vectorized")
    st = pstats.Stats(prof)
    total = st.total_tt  # type: ignore[attr-defined]
    items = st.stats.items()  # type: ignore[attr-defined]

    def rows(chosen: list) -> list[dict]:
        return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_seconds": round(tt, 4),
                 "cumulative_seconds": round(ct, 4), "cumulative_share": round(ct / total, 3)}
                for (f, line, name), (_, nc, tt, ct, _) in chosen]

    own = sorted(items, key=lambda kv: -kv[1][2])[:top]
    ours = sorted((kv for kv in items if "/fedheads/" in kv[0][0]), key=lambda kv: -kv[1][3])[:top]
    return {"total_seconds": round(total, 4), "by_own_time": rows(own), "fedheads_by_cumulative_time": rows(ours)}


def spread(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "samples": [float(x) for x in xs]}


def summarise(runs: dict[str, list[dict]], accs: dict[str, dict[int, float]], rounds: int,
              models: dict[str, dict[int, dict[str, np.ndarray]]]) -> dict:
    """Per framework: the spreads over repeats, rounds per second, the accuracy curve; beside
    fedheads (when it ran): the time ratio, the final accuracy gap, agreement within 1 point and
    the largest difference of a final parameter."""
    out: dict = {}
    for fw, rs in runs.items():
        wall = spread([r["wall_seconds"] for r in rs])
        out[fw] = {"wall_seconds": wall, "cpu_seconds": spread([r["cpu_seconds"] for r in rs]),
                   "process_cpu_seconds": spread([r["process_cpu_seconds"] for r in rs]),
                   "peak_rss_bytes": spread([r["peak_rss_bytes"] for r in rs]),
                   "rounds_per_second": rounds / wall["median"], "accuracy_by_round": accs[fw],
                   "final_accuracy": accs[fw][max(accs[fw])]}
    ref = out.get("fedheads")
    for fw, o in out.items():
        if ref is not None:
            o["time_ratio_to_fedheads"] = o["wall_seconds"]["median"] / ref["wall_seconds"]["median"]
            o["accuracy_gap_points"] = o["final_accuracy"] - ref["final_accuracy"]
            o["agrees"] = abs(o["accuracy_gap_points"]) <= 1.0
            last = max(models["fedheads"])
            o["max_parameter_difference"] = max(float(np.abs(v - models["fedheads"][last][k]).max())
                                                for k, v in models[fw][last].items())
    return out


def markdown(result: dict) -> str:
    lines = ["| case | framework | wall s | rounds/s | CPU s | peak RSS MB | final acc % | x fedheads |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, case in result["cases"].items():
        for fw, o in case["frameworks"].items():
            lines.append(f"| {name} | {fw} | {o['wall_seconds']['median']:.2f} | {o['rounds_per_second']:.2f} | "
                         f"{o['cpu_seconds']['median']:.2f} | {o['peak_rss_bytes']['median'] / 1e6:.0f} | "
                         f"{o['final_accuracy']:.2f} | {o.get('time_ratio_to_fedheads', float('nan')):.1f} |")
        b = case.get("bound")
        if b:
            lines.append(f"| {name} | machine bound | {b['bound_seconds_per_round'] * case['federation']['rounds']:.3f} | "
                         f"| | | | fedheads {case['fedheads_multiple_of_bound']:.1f}x per training round "
                         f"({case['fedheads_whole_run_multiple_of_bound']:.1f}x whole run) |")
    missing = [f"{fw}: {s['missing']}" for fw, s in result["peers"].items() if "missing" in s]
    return "\n".join(lines + ([""] + [f"Not run: {m}" for m in missing] if missing else [])) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["cases"])
    fws = [fw for fw in FRAMEWORKS if any(fw in c["frameworks"] for c in result["cases"].values())]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 3.6))
    width = 0.8 / max(1, len(fws))
    for j, fw in enumerate(fws):
        ys = [result["cases"][n]["frameworks"].get(fw, {}).get("wall_seconds", {}).get("median", np.nan) for n in names]
        ax.bar(np.arange(len(names)) + j * width, ys, width, label=fw)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, fontsize=8)
    ax.set_ylabel("wall seconds per run (median)")
    ax.set_title(f"{'--quick, not a figure: ' if result['quick'] else ''}{result['threads']} threads, "
                 f"{result['repeats']} repeats", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # never over a bar
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse_rounds(spec: str, protocols: list[str]) -> dict[str, int]:
    """--rounds: "" (none), "N" (every protocol) or "PROTOCOL=N,..."; SystemExit naming a bad item."""
    if not spec.strip():
        return {}
    if "=" not in spec:
        items = [(p, spec) for p in protocols]
    else:
        items = [tuple(x.split("=", 1)) for x in spec.split(",") if x.strip()]  # type: ignore[misc]
    out = {}
    for name, n in items:
        name = name.strip()
        if name not in protocols:
            raise SystemExit(f"error: --rounds {spec}: unknown protocol {name!r} (one of {', '.join(protocols)})")
        if not n.strip().isdigit() or int(n) < 1:
            raise SystemExit(f"error: --rounds {spec}: {n!r} is not a positive number of rounds")
        out[name] = int(n)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--heads", default="linear,mlp", help="heads to run where a protocol has them")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", default="", help="override the protocols' rounds: N for every protocol, or "
                    "PROTOCOL=N,... (e.g. crossdevice=30,skewed=30: as many as fit a few minutes per framework)")
    ap.add_argument("--lr", type=float, default=0.05, help="client SGD learning rate")
    ap.add_argument("--batch", type=int, default=10, help="local batch size (>= every client's rows: one full-batch "
                    "step per epoch, so every framework must give the same model up to float rounding)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--fashion-mnist", default=str(FMNIST))
    ap.add_argument("--features", default="", help=".npz of 1280-d features (x_train, y_train, x_test, y_test)")
    ap.add_argument("--store", default="", help="an embedcache store whose --backbone features protocols 2-3 use")
    ap.add_argument("--backbone", default="efficientnet-lite0")
    ap.add_argument("--site", action="append", default=[], help="folder of the installed peers (added to PYTHONPATH)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['clients']} clients, {QUICK['per_round']} per round, "
                    f"{QUICK['rounds']} rounds, 1 repeat (checks every path, not a figure)")
    ap.add_argument("--out", default=str(HERE / "results" / "peers.json"))
    ap.add_argument("--replot", metavar="JSON", default="", help="redraw JSON's .md and .png beside it from its figures; "
                    "nothing runs")
    a = ap.parse_args(argv)
    if a.replot:
        kept = json.loads(Path(a.replot).read_text())
        Path(a.replot).with_suffix(".md").write_text(markdown(kept))
        plot(kept, Path(a.replot).with_suffix(".png"))
        return kept
    rounds_override = parse_rounds(a.rounds, list(PROTOCOLS))
    env = child_env(*(Path(s).resolve() for s in a.site or [p for p in [os.environ.get("BENCH_PEERS_SITE")] if p]))
    repeats = 1 if a.quick else a.repeats
    peers = peer_status(env)
    fws = [fw for fw in a.frameworks.split(",") if fw and "missing" not in peers[fw]]
    for fw, s in peers.items():
        if "missing" in s:
            print(f"{fw}: not run ({s['missing']})", flush=True)
    result: dict = {"method": "\n\n".join(__doc__.split("\n\n")[1:3]), "machine": machine("cpu"), "threads": a.threads,
                    "repeats": repeats, "quick": a.quick, "lr": a.lr, "batch": a.batch, "epochs": EPOCHS, "peers": peers,
                    "load_average_at_start": list(os.getloadavg()), "data": {}, "cases": {}}
    out = Path(a.out)
    with tempfile.TemporaryDirectory() as tmp:
        for pname in a.protocols.split(","):
            proto = dict(PROTOCOLS[pname])
            n_test = QUICK["test"] if a.quick else 10_000
            if a.quick:
                proto.update(clients=QUICK["clients"], per_round=QUICK["per_round"] * (2 if pname == "skewed" else 1),
                             rounds=QUICK["rounds"])
            if pname in rounds_override:
                proto["rounds"] = rounds_override[pname]
            if proto["dim"] == 784:
                data, source = fashion_mnist(Path(a.fashion_mnist)), f"Fashion-MNIST pixels from {a.fashion_mnist}"
            else:
                if a.store:
                    data, source = store_features(a.store, a.backbone), f"{a.backbone} features from {shown(a.store)}"
                else:
                    data = (tuple(np.load(a.features)[k] for k in ("x_train", "y_train", "x_test", "y_test"))
                            if a.features else None)
                    source = f"features from {shown(a.features)}"
            if data is None:
                data = synthetic(proto["dim"], 6_000 if a.quick else 60_000, n_test, a.seed)
                source = f"synthetic: {CLASSES} Gaussian class clusters, {proto['dim']}-d (real data absent)"
            result["data"][pname] = source
            xte, yte = torch.from_numpy(np.ascontiguousarray(data[2][:n_test])), torch.from_numpy(data[3][:n_test])
            for head in proto["heads"]:
                if head not in a.heads.split(","):
                    continue
                name = f"{pname}/{head}"
                cdir = Path(tmp) / name.replace("/", "-")
                facts = write_case(cdir, data, proto, HIDDEN if head == "mlp" else 0, a.lr, a.batch, a.threads,
                                   a.seed)
                runs: dict[str, list[dict]] = {fw: [] for fw in fws}
                load0 = os.getloadavg()
                for i in range(repeats):
                    for fw in (fws if i % 2 == 0 else fws[::-1]):
                        runs[fw].append(run_child(cdir, fw, cdir / f"{fw}-{i}.npz", env))
                        print(f"{name} {fw} #{i}: {runs[fw][-1]['wall_seconds']:.2f} s", flush=True)
                models = {fw: kept_models(cdir / f"{fw}-0.npz") for fw in fws}
                accs = {fw: {r: accuracy(p, xte, yte) for r, p in sorted(m.items())} for fw, m in models.items()}
                case = {"protocol": pname, "head": head, "data": source, "federation": facts,
                        "frameworks": summarise(runs, accs, facts["rounds"], models),
                        "load_average_before": list(load0), "load_average_after": list(os.getloadavg())}
                if "fedheads" in fws:
                    case["bound"] = bound(facts, a.threads)
                    b = case["bound"]["bound_seconds_per_round"]
                    rounds = [float(np.median(r["round_seconds"])) for r in runs["fedheads"]]
                    case["fedheads_round_seconds"] = spread(rounds)  # median training round, per repeat
                    case["fedheads_multiple_of_bound"] = float(np.median(rounds)) / b
                    whole = case["frameworks"]["fedheads"]["wall_seconds"]["median"] / facts["rounds"]
                    case["fedheads_whole_run_multiple_of_bound"] = whole / b  # setup and final evaluation included
                    if not a.no_profile:
                        case["fedheads_profile"] = profile_fedheads(cdir, a.threads)
                result["cases"][name] = case
                for fw, o in case["frameworks"].items():
                    print(f"  {fw:14s} {o['wall_seconds']['median']:8.2f} s  acc {o['final_accuracy']:.2f} "
                          f"x{o.get('time_ratio_to_fedheads', float('nan')):.1f}", flush=True)
                result["load_average_at_end"] = list(os.getloadavg())
                write_json(result, out)
    (out.with_suffix(".md")).write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md').name}, {out.with_suffix('.png').name}")
    return result


if __name__ == "__main__":
    main()
