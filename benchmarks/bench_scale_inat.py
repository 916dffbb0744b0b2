"""Training-free heads at a real federation's scale: one pass over the 9,275 clients of
iNaturalist-Users-120K, against the machine's own floors.

Store: benchmarks/inat_store.py (the federation's exact client sizes, 120,293 training rows,
median 2 per client; 1,203 long-tailed, client-skewed classes; 1280-d float32 features; the test
set's 35,637 rows dealt out so every client has at least one), built once into a cache directory.
"Feature bytes" are ALL the features, train and test (4 * 1280 * rows), as bench_scale.py counts them.

Measured, each in a fresh subprocess (bench_memory.CHILD_PRELUDE: everything imported first,
RSS taken as the baseline, the kernel's peak-RSS counter reset, VmHWM read at the end), with the
same torch threads, `--repeats` times interleaved:
  * `read`: one checked read of every client's train and test features (embedcache.store.reader
    .iter_split_chunks, as `fedheads train` reads them): the floor of any one-pass head; the
    time of opening the store (embedcache.store.reader.open_store: its metadata) is given apart;
  * each of `--algorithms` (default fedncm, fed3r, fedcof; a name `fedheads algorithms` does not
    list is skipped with a note; NAME:KEY=VALUE[,KEY=VALUE] runs NAME with those settings, e.g.
    fedcof:dtype=float32; the key `layout` sets the command's --layout, e.g. fedcof:layout=streamed,
    which reads each bucket from the store when the round or the evaluation needs it instead of
    loading the features first): `fedheads train --rounds 1 --fraction 1 --eval-every 1`, one
    pass over all clients: the command's wall time (goal < 60 s), its one pass (loading plus the
    round, from results.json; goal for Fed3R: within 3x of `read`) and evaluation apart, and peak
    memory above the baseline as a multiple of the feature bytes (goal <= 1.5x);
  * `lp`: the FedAvg linear probe at `--lp-clients` (100) clients per round for `--lp-rounds` (50)
    rounds, evaluated after the last: seconds per round. Run with `--set lp.local_models=false`
    (lp.py): no client keeps a head between rounds, so memory follows the round's participants;
    `--lp-local-models` keeps every client's last local head (the "local_model" rule, LP's
    default) at one C x (D+1) head per client of the federation;
  * the machine's floors, in the same kind of subprocess: float64 GEMM rate at the Gram shapes
    (torch.matmul [1281, n] x [n, 1281] for n = 4096, the pooled Gram; and batched [B, 1281, r] x
    [B, r, 1281] for r = 2 rows, a median client's own Gram), and memory bandwidth (a large
    tensor copy: bytes read + written per second).
A child whose resident memory passes `--mem-limit-gb` (default: 80 % of the memory available at
start) is killed and recorded as such, with its RSS and seconds at the kill, and not repeated. `--profile NAME`
runs one more measurement of NAME under cProfile and writes the top functions by cumulative time
(OUT with .profile.txt), and their first lines into the JSON: where the time goes.

Usage: python benchmarks/bench_scale_inat.py [--algorithms fedncm,fed3r,fedcof] [--repeats 3]
       [--profile fed3r] [--quick]
Writes benchmarks/results/scale_inat.json (after every measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_memory import CHILD_PRELUDE  # sibling modules: the same measured process
from inat_store import InatConfig, build
from machine_info import child_env, machine, provenance, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DIM = 1280

# runs inside the measured subprocess: argv[1] = JSON {"mode", "store", "out", "threads", "profile", ...}
CHILD = CHILD_PRELUDE + r"""
import time, cProfile, io, pstats

def work():
    m = a["mode"]
    if m == "read":
        from embedcache.store.reader import iter_split_chunks, open_store
        t = time.perf_counter()
        info = open_store(a["store"], quiet=True)
        opened = time.perf_counter() - t
        rows = 0
        for split in ("train", "test"):
            for c in info.clients:
                for x, y, _ in iter_split_chunks(info, ["synthetic"], split, c):
                    rows += len(y)
        return {"rows": rows, "open_store_seconds": opened}
    if m == "gemm":
        n, d, b, r = a["gemm_n"], a["gemm_d"], a["gemm_batch"], a["gemm_r"]
        g = torch.Generator().manual_seed(0)
        out = {}
        for name, (p, q), flops in (("pooled", ((d, n), (n, d)), 2.0 * n * d * d),
                                    ("per_client", ((b, d, r), (b, r, d)), 2.0 * b * r * d * d)):
            x, y = torch.randn(*p, dtype=torch.float64, generator=g), torch.randn(*q, dtype=torch.float64, generator=g)
            torch.matmul(x, y)
            ts = []
            for _ in range(a["gemm_repeats"]):
                t = time.perf_counter(); torch.matmul(x, y); ts.append(time.perf_counter() - t)
            out[name] = {"shape": [list(p), list(q)], "seconds": min(ts), "gflops": flops / min(ts) / 1e9}
        src = torch.ones(a["copy_bytes"] // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        ts = []
        for _ in range(a["gemm_repeats"]):
            t = time.perf_counter(); dst.copy_(src); ts.append(time.perf_counter() - t)
        out["copy"] = {"bytes": a["copy_bytes"], "seconds": min(ts), "gb_per_s": 2 * a["copy_bytes"] / min(ts) / 1e9}
        return out
    fedheads.cli.main(["train", "--store", a["store"], "--backbones", "synthetic", "--algorithm", m,
                       "--rounds", str(a["rounds"]), "--fraction", repr(a["fraction"]), "--seeds", "0",
                       "--device", "cpu", "--eval-every", str(a["eval_every"]), "--layout", a.get("layout", "auto"),
                       "--quiet", "--out", a["out"],
                       *[x for kv in a.get("settings", []) for x in ("--set", kv)]],
                      standalone_mode=False)
    return {}

t0 = time.perf_counter()
if a["profile"]:
    prof = cProfile.Profile()
    r = prof.runcall(work)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    s.write("== the project's functions by cumulative time\n")
    st.sort_stats("cumulative").print_stats(r"(fedheads|embedcache)/", 30)
    s.write("== every function by its own time\n")
    st.sort_stats("tottime").print_stats(20)
    r["profile"] = s.getvalue()
else:
    r = work()
r["seconds"] = time.perf_counter() - t0
rss, hwm = status()
r.update({"baseline_rss": base, "peak_rss": hwm, "peak_reset": reset})
print("RESULT " + json.dumps(r))
"""


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def sanitized(text: str) -> str:
    """A profile's file names without this machine's directories (the repository, the Python install)."""
    text = text.replace(str(REPO) + os.sep, "")
    return re.sub(r"[^\s(]*/(site-packages|lib/python3\.\d+)/", r"<\1>/", text)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "samples": [round(x, 4) for x in xs]}


def child(args: dict, limit: int, timeout: float) -> dict:
    """Run CHILD with `args`; kill it when its RSS passes `limit` bytes. The parsed RESULT, or
    {"failed": why}."""
    env = child_env()
    load0 = os.getloadavg()
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], env=env, stdout=out, stderr=err, text=True)
        peak, why = 0, None
        while p.poll() is None:
            peak = max(peak, rss_of(p.pid))
            if peak > limit:
                p.kill()
                why = f"killed: resident memory {peak / 1e9:.1f} GB passed the limit {limit / 1e9:.1f} GB"
            elif time.perf_counter() - t > timeout:
                p.kill()
                why = f"killed: still running after {timeout:.0f} s"
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    secs = round(time.perf_counter() - t, 2)
    if why or p.returncode != 0:
        tail = stderr.strip().splitlines()[-1:] if not why else []
        return {"failed": why or f"exit {p.returncode}: {tail[0] if tail else ''}", "process_seconds": secs,
                "max_rss_sampled": peak, "load_average_before": list(load0)}
    r = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    r.update({"process_seconds": secs, "load_average_before": list(load0), "load_average_after": list(os.getloadavg())})
    return r


def run_case(name: str, store: Path, tmp: Path, k: int, a: argparse.Namespace, clients: int, profile: bool = False) -> dict:
    """One measurement of case `name`: "read", "lp", or a head as `--algorithms` names it
    ("fedcof", or "fedcof:dtype=float32" for that setting: `--set fedcof.dtype=float32`; the key
    `layout` is the command's --layout: "fedcof:layout=streamed")."""
    lp = name == "lp"
    mode, settings, layout = case_args(name, a.lp_local_models)
    label = re.sub(r"[^\w.-]", "_", name)
    args = {"mode": mode, "store": str(store), "out": str(tmp / f"{label}-{k}{'-prof' if profile else ''}"),
            "threads": a.threads, "profile": profile, "rounds": a.lp_rounds if lp else 1,
            "fraction": min(1.0, a.lp_clients / clients) if lp else 1.0, "eval_every": 0 if lp else 1,
            "settings": settings, "layout": layout}
    r = child(args, a.limit, a.timeout)
    if "failed" in r or name == "read":
        return r
    res = json.loads((Path(args["out"]) / "results.json").read_text())
    timing = res["timing"]
    rounds = timing["per_seed"][0]["rounds"]
    r.update({"load_seconds": timing["load_wall_seconds"], "round_seconds": rounds["train_wall_seconds"],
              "eval_seconds": rounds["eval_wall_seconds"], "train_wall_seconds": timing["wall_seconds"],
              "accuracy": res["accuracy"]["mean"], "layout": res.get("layout")})
    return r


def summarise(name: str, reps: list[dict], feature_bytes: int) -> dict:
    ok = [r for r in reps if "failed" not in r]
    out: dict = {"repeats": reps}
    if not ok:
        out["failed"] = reps[0]["failed"]
        return out
    out["seconds"] = spread([r["seconds"] for r in ok])
    peaks = [r["peak_rss"] - r["baseline_rss"] for r in ok]
    out["peak_above_baseline_bytes"] = spread(peaks)
    out["multiple_of_feature_bytes"] = spread([p / feature_bytes for p in peaks])
    if name == "read":  # the store's metadata (open_store, which every command does) apart from the features
        out["open_store_seconds"] = spread([r["open_store_seconds"] for r in ok])
    if name not in ("read", "gemm"):
        out["accuracy"] = ok[0]["accuracy"]
        out["load_seconds"] = spread([r["load_seconds"] for r in ok])
        rounds = [x for r in ok for x in r["round_seconds"]]
        out["seconds_per_round" if name == "lp" else "round_seconds"] = spread(rounds)
        out["eval_seconds"] = spread([sum(r["eval_seconds"]) for r in ok])
        if name != "lp":  # the head's one pass: loading the features and the round, without evaluation
            out["pass_seconds"] = spread([r["load_seconds"] + sum(r["round_seconds"]) for r in ok])
    return out


def parse_heads(text: str) -> list[str]:
    """`--algorithms` as cases: NAME[:KEY=VALUE[,KEY=VALUE]], a bare KEY=VALUE belonging to the head before it."""
    heads: list[str] = []
    for h in (x for x in text.split(",") if x):
        if heads and "=" in h and ":" not in h and ":" in heads[-1]:
            heads[-1] += "," + h
        else:
            heads.append(h)
    return heads


def case_args(name: str, lp_local_models: bool = False) -> tuple[str, list[str], str]:
    """(the algorithm, its --set settings, the --layout) of case `name` (run_case)."""
    mode, _, variant = name.partition(":")
    pairs = [kv for kv in variant.split(",") if kv]
    layout = next((kv.partition("=")[2] for kv in pairs if kv.startswith("layout=")), "auto")
    settings = [f"{mode}.{kv}" for kv in pairs if not kv.startswith("layout=")]
    if name == "lp" and not lp_local_models:
        settings.append("lp.local_models=false")
    return mode, settings, layout


def registered() -> set[str]:
    from fedheads.algorithms import list_algorithms

    return {i.name for i in list_algorithms()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", default="fedncm,fed3r,fedcof",
                    help="one-pass heads, NAME or NAME:KEY=VALUE[,KEY=VALUE] (unregistered: skipped)")
    ap.add_argument("--lp-clients", type=int, default=100)
    ap.add_argument("--lp-rounds", type=int, default=50)
    ap.add_argument("--no-lp", action="store_true", help="skip the LP run")
    ap.add_argument("--lp-local-models", action="store_true",
                    help="LP keeps every client's last local head (one per client of the federation)")
    ap.add_argument("--clients", type=int, default=None, help="M sizes at the shape's quantiles (default: all 9,275)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None, help="where the store is built (inat_store.default_cache())")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per measurement (interleaved)")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="kill a child above this RSS (default: 80%% of MemAvailable)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="kill a child after this many seconds")
    ap.add_argument("--profile", default="", help="also run this measurement once under cProfile")
    ap.add_argument("--quick", action="store_true",
                    help="100 clients of the same shape, 1 repeat, LP 3 rounds of 20 clients (checks the script, not a figure)")
    ap.add_argument("--out", default=str(HERE / "results" / "scale_inat.json"))
    a = ap.parse_args()
    if a.quick:
        a.clients, a.repeats, a.lp_rounds, a.lp_clients = a.clients or 100, 1, 3, 20
    a.limit = int(a.mem_limit_gb * 1e9) if a.mem_limit_gb else int(0.8 * mem_available())
    known = registered()
    heads = parse_heads(a.algorithms)
    notes = [f"{h}: not a registered algorithm here (fedheads algorithms), skipped" for h in heads
             if h.partition(":")[0] not in known]
    heads = [h for h in heads if h.partition(":")[0] in known]
    cases = ["read", *heads, *([] if a.no_lp else ["lp"])]
    store, facts = build(InatConfig(seed=a.seed, clients=a.clients), a.cache_dir, progress=True)
    fb = facts["feature_bytes"]
    n_gram = facts["train_rows"]
    # the command and commit as the run starts: the JSON written after each measurement is itself tracked
    result: dict = {**provenance(), "method": __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[2],
                    "machine": machine("cpu"), "threads": a.threads, "repeats": a.repeats, "quick": a.quick,
                    "memory_limit_bytes": a.limit, "store": facts, "notes": notes,
                    "lp": {"clients_per_round": a.lp_clients, "rounds": a.lp_rounds, "local_models": a.lp_local_models},
                    "runs": {}}
    print(f"store {store}: {facts['clients']} clients, {facts['train_rows']} train / {facts['test_rows']} test rows, "
          f"{fb / 1e9:.2f} GB features", flush=True)
    for n in notes:
        print("  " + n, flush=True)
    gemm = {"mode": "gemm", "threads": a.threads, "profile": False, "gemm_n": 4096, "gemm_d": DIM + 1,
            "gemm_batch": 16, "gemm_r": 2, "gemm_repeats": 3, "copy_bytes": (64 if a.quick else 1024) << 20}
    result["floors"] = floors = child(gemm, a.limit, a.timeout)
    if "failed" not in floors:
        pooled = floors["pooled"]["gflops"] * 1e9
        floors["gram_flops"] = 2.0 * n_gram * (DIM + 1) ** 2
        floors["gram_seconds_at_pooled_rate"] = round(floors["gram_flops"] / pooled, 3)
        floors["feature_bytes_seconds_at_copy_rate"] = round(fb / (floors["copy"]["gb_per_s"] * 1e9 / 2), 3)
        print(f"  GEMM float64 {floors['pooled']['gflops']:.1f} GFLOP/s pooled, {floors['per_client']['gflops']:.1f} "
              f"per client (r=2); copy {floors['copy']['gb_per_s']:.1f} GB/s; the training Gram at the pooled "
              f"rate: {floors['gram_seconds_at_pooled_rate']:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        reps: dict[str, list[dict]] = {c: [] for c in cases}
        for k in range(a.repeats):  # interleaved, so load drifts hit every case alike
            for c in cases:
                if any("failed" in r for r in reps[c]):
                    continue  # a failed run (killed at a limit, or an error) is not repeated: it would fail again
                r = run_case(c, store, Path(tmp), k, a, facts["clients"])
                reps[c].append(r)
                msg = r.get("failed") or (f"{r['seconds']:.1f} s, peak {(r['peak_rss'] - r['baseline_rss']) / fb:.2f}x "
                                          f"features" + (f", accuracy {r['accuracy']:.1f}" if "accuracy" in r else ""))
                print(f"  [{k}] {c:8s} {msg}", flush=True)
                result["runs"][c] = summarise(c, reps[c], fb)
                write_json(result, a.out)
        read = result["runs"]["read"].get("seconds", {}).get("median")
        for c in heads:
            run = result["runs"][c]
            if "seconds" in run and read:
                run["pass_multiple_of_read_seconds"] = round(run["pass_seconds"]["median"] / read, 2)
                run["goal_under_60s"] = run["seconds"]["median"] < 60
                run["goal_peak_le_1p5x"] = run["multiple_of_feature_bytes"]["median"] <= 1.5
            if "round_seconds" in run and "gram_seconds_at_pooled_rate" in floors:  # Fed3R's cost is the Grams
                run["round_over_gram_seconds_at_pooled_rate"] = round(
                    run["round_seconds"]["median"] / floors["gram_seconds_at_pooled_rate"], 2)
        if a.profile and a.profile not in cases:
            notes.append(f"--profile {a.profile}: not among the measurements ({', '.join(cases)}), not profiled")
        elif a.profile:
            r = run_case(a.profile, store, Path(tmp), 0, a, facts["clients"], profile=True)
            text = sanitized(r.pop("profile", r.get("failed", "")))
            Path(a.out).with_suffix(".profile.txt").write_text(text)
            result["profile"] = {"case": a.profile, "file": Path(a.out).with_suffix(".profile.txt").name,
                                 "top": [ln for ln in text.splitlines() if ln.strip()][:45]}
    write_json(result, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
