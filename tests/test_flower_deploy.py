"""Real processes on loopback: `fedheads serve` (a Flower SuperLink + the ServerApp) and three
`fedheads join` (SuperNodes), each node with its own small store or manifest. Everything binds
127.0.0.1, every wait is on readiness (a line in a log, a file) and has a timeout sized for a
loaded 2-core machine, and every process is stopped by its PID (process group); the children also
get SIGTERM if this test process dies (fedheads.children)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flower_helpers import FLOWER_MISSING  # noqa: E402

pytest.importorskip("flwr", reason=FLOWER_MISSING)
pytestmark = pytest.mark.slow

from flower_helpers import CLIENTS, write_store  # noqa: E402

from fedheads import children  # noqa: E402
from fedheads.flower.deploy import first_error, free_port  # noqa: E402
from fedheads.flower.secure import error_bound  # noqa: E402

# seconds; a load of 10 on 2 cores: every Flower message starts a process (~10x its idle time)
RUN_LIMIT = 900  # one whole deployment
READY_S = 240  # one process up and answering


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedheads.cli", *args]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(15)


class Deployment:
    """serve + nodes, stopped by PID whatever happens."""

    def __init__(self, tmp: Path, serve_args: list[str], nodes: list[list[str]]) -> None:
        self.tmp, self.port, self.out = tmp, free_port(), tmp / "run"
        self.procs: list[subprocess.Popen] = []
        logs = tmp / "logs"
        logs.mkdir(exist_ok=True)
        self.serve = self._start(_cli("serve", "--nodes", str(len(nodes)), "--port", str(self.port), "--host", "127.0.0.1",
                                      "--wait", str(READY_S), "--out", str(self.out), *serve_args), logs / "serve.log")
        try:
            _wait_for_line(self.serve, logs / "serve.log", "SuperLink on ", READY_S)  # ready before the nodes dial
            self.nodes = [self._start(_cli("join", "--superlink", f"127.0.0.1:{self.port}", *n), logs / f"node{i}.log")
                          for i, n in enumerate(nodes)]
        except BaseException:  # no caller holds this object yet to close it
            self.close()
            raise

    def _start(self, cmd: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:  # SIGTERM to the child if this process dies (kept across join's execve)
            p = children.popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.serve.wait(RUN_LIMIT)
        except subprocess.TimeoutExpired:
            rc = -1
        log = (self.tmp / "logs" / "serve.log").read_text(errors="replace")
        if rc == -1:
            log += f"\n(serve did not finish within {RUN_LIMIT} s; Flower's log says: {first_error(self.out / 'flower.log')})"
        return rc, log

    def close(self) -> None:
        for p in reversed(self.procs):
            _kill(p)
        pid_file = self.out.parent / f".{self.out.name}.flower" / "superlink.pid"
        if pid_file.exists():  # serve stops it itself; this is the safety net
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_for_line(proc: subprocess.Popen, log: Path, text: str, limit: float) -> None:
    """Until `log` holds `text`; one clear failure when `proc` exits first or `limit` s pass."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        said = log.read_text(errors="replace") if log.is_file() else ""
        if text in said:
            return
        if proc.poll() is not None:
            raise AssertionError(f"{log.name}: the process exited ({proc.returncode}) before {text!r}: {said[-2000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{log.name}: no {text!r} within {limit:.0f} s (a loaded machine?): {first_error(log)}")


def run_deployment(tmp: Path, serve_args: list[str], nodes: list[list[str]]) -> Path:
    """Serve + one `join` per entry of `nodes` until serve exits (every process stopped by PID
    whatever happens); asserts that the run succeeded and returns its --out folder."""
    dep = Deployment(tmp, serve_args, nodes)
    try:
        rc, log = dep.wait()
    finally:
        dep.close()
    assert rc == 0, log[-3000:]
    return dep.out


def run_secagg_fedncm(tmp: Path, stores: dict[str, Path], *extra: str) -> Path:
    """`run_deployment` of one round of FedNCM under SecAgg+ (plus `extra` serve options) over one
    node per store."""
    return run_deployment(tmp, ["--algorithm", "fedncm", "--backbones", "synth", "--rounds", "1", "--secagg",
                                "--timeout", "180", *extra],
                          [["--store", str(stores[c])] for c in CLIENTS])


@pytest.fixture
def node_stores(tmp_path):
    """Each node's own store (its client only) and the union the engine trains on."""
    stores = {c: write_store(tmp_path / f"node-{c}", only=c) for c in CLIENTS}
    return stores, write_store(tmp_path / "union")


def test_secagg_fedncm_over_three_nodes_gives_the_class_means_of_train(tmp_path, node_stores):
    from click.testing import CliRunner

    from fedheads.cli import main

    stores, union = node_stores
    out = run_secagg_fedncm(tmp_path, stores)
    ref_dir = tmp_path / "ref"
    r = CliRunner().invoke(main, ["train", "--store", str(union), "--backbones", "synth", "--algorithm", "fedncm",
                                  "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(ref_dir)])
    assert r.exit_code == 0, r.output
    got = torch.load(out / "state" / "seed0.server.pt", weights_only=True)["server"]
    ref = torch.load(ref_dir / "state" / "seed0.pt", weights_only=True)["server"]
    sums, counts, means, present = got
    assert torch.equal(counts, ref[1]) and torch.equal(present, ref[3])
    assert (means - ref[2]).abs().max() < error_bound(3, 10) / counts.min()  # sums < 2^10 here
    res = json.loads((out / "results.json").read_text())
    assert res["engine"] == "flower-secagg" and len(res["flower"]["nodes"]) == 3
    received = [json.loads(line) for line in (out / "received.jsonl").read_text().splitlines()]
    updates = [a for a in received if a["type"] == "train.update"]
    assert len(updates) == 3 and all(a["arrays"] == {} for a in updates)  # no sum in the clear
    masked = [a for a in received if "masked_params" in a["configs"].get("secaggplus_configs", [])]
    assert len(masked) == 3 and all(all(v == [] for v in a["arrays"].values()) for a in masked)


def test_distributed_dp_under_secagg_over_three_nodes_writes_the_privacy_block(tmp_path, node_stores):
    """Each node clips its features and adds its share of the noise from its own secret key; the
    server adds none, sees only the SecAgg+ totals and the nodes' release counts, and accounts."""
    from fedheads.algorithms.fedncm import client_stats
    from fedheads.privacy import bounded, epsilon
    from fedheads.run.load import load_fed_data

    stores, union = node_stores
    out = run_secagg_fedncm(tmp_path, stores, "--dp-noise-multiplier", "0.5", "--dp-clip", "3", "--dp-mode", "distributed")
    p = json.loads((out / "results.json").read_text())["privacy"]
    assert p["mode"] == "distributed" and p["noise_seed"] == "secret" and p["releases_per_example"] == 1
    assert p["noise_multiplier"] == 0.5 and p["epsilon"] == pytest.approx(epsilon(0.5, 1e-5, 1))
    sums = torch.load(out / "state" / "seed0.server.pt", weights_only=True)["server"][0]
    data = bounded(load_fed_data(str(union), ["synth"], "cpu"), 3.0, "clip")
    clean = client_stats(data.x_train, data.y_train, data.m_train, data.num_classes)[0].sum(0)
    gap = (sums.double() - clean.double()).abs().max().item()
    assert 0.1 < gap < 10 * p["noise_std"]["sums"]  # the nodes' noise: present, and of its stated scale
    received = [json.loads(line) for line in (out / "received.jsonl").read_text().splitlines()]
    updates = [a for a in received if a["type"] == "train.update"]
    assert len(updates) == 3 and all(a["arrays"] == {} and "fh.releases" in a["configs"] for a in updates)


def test_plain_fedpcl_nodes_extract_their_own_images_and_equal_the_engine(tmp_path):
    """Nodes hold manifests of their own images (builtin digits): they extract on first use."""
    from fedheads.core.engine import run
    from fedheads.run.load import load_fed_data
    from fedheads.run.train import TrainOptions, build_algorithm

    manifest = tmp_path / "m.json"
    subprocess.run([sys.executable, "-m", "embedcache.cli", "partition", "builtin:digits", "--scheme", "feature-shift",
                    "--train-per-class", "2", "--test-per-class", "2", "--out", str(manifest)], check=True, timeout=120)
    names = [c["name"] for c in json.loads(manifest.read_text())["clients"]][:3]
    out = run_deployment(tmp_path, ["--algorithm", "fedpcl", "--backbones", "digitnet-builtin", "--rounds", "2",
                                    "--eval-every", "0", "--timeout", "240"],
                         [["--store", str(tmp_path / f"node{i}" / "s.zarr"), "--manifest", str(manifest), "--client", c]
                          for i, c in enumerate(names)])
    for i in range(3):
        assert (tmp_path / f"node{i}" / "s.zarr" / "digitnet-builtin" / names[i]).is_dir()
    union = tmp_path / "union.zarr"
    subprocess.run([sys.executable, "-m", "embedcache.cli", "extract", "--manifest", str(manifest), "--store", str(union),
                    "--backbones", "digitnet-builtin", "--device", "cpu", "--quiet"], check=True, timeout=300)
    alg, _, _ = build_algorithm("fedpcl", TrainOptions(), strict=True)
    ref = run(alg, load_fed_data(str(union), ["digitnet-builtin"], "cpu", clients=names), 2, seed=0, engine="loop",
              progress=False)
    got = json.loads((out / "results.json").read_text())
    want = {n: 100.0 * float(a) for n, a in zip(names, ref.final_accuracy().tolist())}
    assert {n: got["per_client"][n]["mean"] for n in names} == pytest.approx(want, abs=1e-9)
    server = torch.load(out / "state" / "seed0.server.pt", weights_only=True)["server"]
    assert torch.equal(server[3], ref.server_state.global_protos)  # bit for bit


def test_a_node_that_dies_mid_run_is_reported_and_the_run_refused(tmp_path, node_stores):
    stores, _ = node_stores
    dep = Deployment(tmp_path, ["--algorithm", "fedncm", "--backbones", "synth", "--rounds", "3", "--eval-every", "0",
                                "--timeout", "40"],
                     [["--store", str(stores[c])] for c in CLIENTS])
    try:
        progress = dep.out / "progress.jsonl"
        t0 = time.monotonic()
        while not (progress.exists() and progress.read_text().strip()) and time.monotonic() - t0 < RUN_LIMIT:
            assert dep.serve.poll() is None, (tmp_path / "logs" / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        os.killpg(dep.nodes[2].pid, signal.SIGKILL)  # c2 dies after round 1
        rc, log = dep.wait()
    finally:
        dep.close()
    assert rc == 2, log[-3000:]
    line = log.strip().splitlines()[-1]
    assert line.startswith("error: round ") and "node c2" in line and "refused" in line, line
    assert not (dep.out / "results.json").exists() and (dep.out / "failed.json").exists()


def _flower_pids(home: Path) -> dict[int, str]:
    """{pid: command line} of the live processes whose environment names FLWR_HOME=`home`: every
    Flower process `serve` started, and the ones they started."""
    want = f"FLWR_HOME={home}".encode()
    found = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if want in (p / "environ").read_bytes().split(b"\0"):
                    found[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:  # gone meanwhile, or a zombie
                pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_serve_killed_by_sigkill_takes_its_superlink_and_flwr_run_with_it(tmp_path):
    """kill -9 skips serve's own clean-up: its children must still stop, and free the port."""
    port, out, logs = free_port(), tmp_path / "run", tmp_path / "serve.log"
    home = tmp_path / ".run.flower"
    with open(logs, "wb") as f:
        serve = subprocess.Popen(_cli("serve", "--nodes", "1", "--wait", str(RUN_LIMIT), "--port", str(port), "--host",
                                      "127.0.0.1", "--algorithm", "fedncm", "--backbones", "synth", "--out", str(out)),
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # ready: the SuperLink answers and `flwr run` has submitted the run (the ServerApp waits for a node)
        _wait_for_line(serve, out / "flower.log", "Successfully started run", READY_S)
        assert len(_flower_pids(home)) >= 2, _flower_pids(home)  # the SuperLink and `flwr run`, at least
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(30)
        deadline = time.monotonic() + 120
        while _flower_pids(home) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _flower_pids(home), f"still running 120 s after serve was killed: {_flower_pids(home)}"
        with socket.socket() as s:  # the port is free again (TIME_WAIT aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        _kill(serve)
        for pid in _flower_pids(home):  # what this test started, should any be left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
