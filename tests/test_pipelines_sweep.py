"""One experiment end to end on the test doubles (a fake Office-10 copy, tiny backbones): the
command writes the report with the published values beside ours, a failed method does not sink
the sweep, a re-run skips complete cells, and serial, `local:2` and a real `tcp://` scheduler on
loopback give the same cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pipelines_doubles as pd
import pytest
from click.testing import CliRunner

from pipelines.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(out: Path, cache: Path, copy: Path, *extra: str):
    args = ["run", "test-sweep", "--plugin", "pipelines_doubles", "--source", f"office10=imagefolder:{copy}",
            "--out", str(out), "--cache", str(cache), "--quiet", *extra]
    return CliRunner().invoke(main, args)


def _accuracies(out: Path) -> dict[str, tuple]:
    """cell hash -> per-client accuracies of every finished cell."""
    got = {}
    for p in (out / "cells").glob("*.json"):
        rec = json.loads(p.read_text())
        if rec["status"] == "done":
            got[rec["hash"]] = tuple(sorted(rec["result"]["seed_result"]["per_client"].items()))
    return got


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    copy = pd.make_folder(root / "office", ("amazon", "caltech10", "dslr", "webcam"), tuple("abcde"), per_class=6)
    res = _run(root / "serial", root / "cache", copy, "--scheduler", "serial")
    return root, copy, res


def test_report_puts_published_values_beside_ours(serial):
    root, _, res = serial
    assert res.exit_code == 1, res.output  # the Broken method's cells failed: the run says so
    assert "4 cells done, 2 failed" in res.output
    edir = root / "serial" / "test-sweep"
    report = (edir / "report.md").read_text()
    assert "FedPCL Table T, row 'Office-10 Ours', column 'Acc'" in report  # provenance
    assert "| 40.00(1.00) |" in report  # the published value beside ours
    assert "batch_size 0" in report  # the failed arm with its error
    results = json.loads((edir / "results.json").read_text())
    assert {c["status"] for c in results["cells"]} == {"done", "failed"} and len(results["cells"]) == 6
    assert (edir / "cells.csv").read_text().count("\n") == 7  # header + 6 cells
    assert (root / "serial" / "index.md").read_text().count("test-sweep/report.md") == 1
    assert (edir / "paper_vs_ours.png").stat().st_size > 0


def test_rerun_skips_complete_cells_and_resumes_a_killed_sweep(serial):
    root, copy, _ = serial
    out = root / "serial"
    done = {p: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json") if not p.name.endswith(".failed.json")}
    assert len(done) == 4
    lost = sorted(done)[0]
    lost.unlink()  # as if the sweep had been killed before this cell finished
    res = _run(out, root / "cache", copy, "--scheduler", "serial")
    assert res.exit_code == 1, res.output
    timing = json.loads((out / "test-sweep" / "plan.json").read_text())["timing"]
    assert timing["cells_to_run"] == 3  # the lost cell and the two failed ones, nothing else
    for p, mtime in done.items():
        assert p.is_file() and (p == lost or p.stat().st_mtime_ns == mtime)


def test_local_cluster_gives_the_serial_cells(serial):
    root, copy, _ = serial  # one worker process: each imports torch (~20 s on a loaded machine)
    res = _run(root / "local", root / "cache", copy, "--scheduler", "local:1")
    assert res.exit_code == 1, res.output
    assert _accuracies(root / "local") == _accuracies(root / "serial") != {}


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


READY_S = 180  # a process start (python + dask imports) on a loaded 2-core machine


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def _tcp_cluster(tmp_path: Path, procs: list[subprocess.Popen]) -> str:
    """A dask scheduler and one worker on loopback (appended to `procs`, stopped by the caller);
    returns the scheduler's address once the worker has registered."""
    from distributed import Client

    dask = Path(sys.executable).with_name("dask")
    if not dask.exists():
        pytest.skip("the dask command is not installed beside this python")
    sfile = tmp_path / "scheduler.json"
    procs.append(subprocess.Popen([str(dask), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                   "--scheduler-file", str(sfile)], env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + READY_S
    while not sfile.is_file() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    assert sfile.is_file(), f"the dask scheduler did not start within {READY_S} s (exit code {procs[0].poll()})"
    address = json.loads(sfile.read_text())["address"]
    assert address.startswith("tcp://127.0.0.1:")
    procs.append(subprocess.Popen([str(dask), "worker", "--scheduler-file", str(sfile), "--host", "127.0.0.1",
                                   "--nworkers", "1", "--nthreads", "1", "--no-dashboard"], env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    with Client(address, timeout=f"{READY_S}s") as c:  # ready: the worker has registered
        c.wait_for_workers(1, timeout=READY_S)
    return address


def test_tcp_scheduler_on_loopback_gives_the_serial_cells(serial, tmp_path):
    root, copy, _ = serial
    procs: list[subprocess.Popen] = []
    try:
        address = _tcp_cluster(tmp_path, procs)
        res = _run(root / "tcp", root / "cache", copy, "--scheduler", address)
        assert res.exit_code == 1, res.output
        assert _accuracies(root / "tcp") == _accuracies(root / "serial") != {}
    finally:
        _stop(procs)


def test_a_killed_scheduler_is_one_line_and_keeps_the_finished_cells(serial, tmp_path):
    """kill -9 the scheduler once a cell has finished: one `error:` line (no traceback, no list of
    futures), exit 2, the finished cell's file kept; a re-run would skip it."""
    root, copy, _ = serial
    out = root / "killed"
    args = ["run", "test-sweep", "--plugin", "pipelines_doubles", "--source", f"office10=imagefolder:{copy}",
            "--out", str(out), "--cache", str(root / "cache"), "--quiet"]
    procs: list[subprocess.Popen] = []
    try:
        address = _tcp_cluster(tmp_path, procs)
        code = ("import pipelines.sweep as s, pipelines_doubles as d\ns.run_cell = d.slow_cell\n"
                f"from pipelines.cli import main\nmain({[*args, '--scheduler', address]!r})\n")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        driver = procs[-1]
        deadline = time.monotonic() + READY_S
        while not list((out / "cells").glob("*.json")) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        assert driver.poll() is None and list((out / "cells").glob("*.json")), \
            f"no cell finished within {READY_S} s, or the sweep ended first: {driver.poll()}"
        procs[0].kill()  # the scheduler, mid-sweep
        _, err = driver.communicate(timeout=READY_S)
    finally:
        _stop(procs)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert driver.returncode == 2, err[-3000:]
    assert "Traceback" not in err and all(len(ln) < 400 for ln in lines), err[-3000:]
    assert lines[-1].startswith("error: scheduler tcp://127.0.0.1:") and "connection lost" in lines[-1], lines[-1]
    assert "finished cells are kept" in lines[-1]
    assert list((out / "cells").glob("*.json"))
