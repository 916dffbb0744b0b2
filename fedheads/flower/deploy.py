"""A real Flower deployment: a SuperLink (`fedheads serve`) and SuperNodes (`fedheads join`).

`serve` starts Flower's SuperLink, writes the Flower App (a pyproject.toml naming
`fedheads.flower.server:app` and `fedheads.flower.node:app`, the run config as its defaults)
and a private Flower home (FLWR_HOME: CLI connection config, installed app bundles), submits
the run with Flower's own `flwr run`, waits for it, and stops the SuperLink by its PID. Every
Flower process gets QUIET_ENV (no telemetry, no update check, no dependency installation), writes
its output to OUT/flower.log (the console gets one line per round) and gets SIGTERM should `serve`
die (fedheads.children). `join` runs a SuperNode with the node's own config (store, client, manifest)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fedheads.children as children
from embedcache.errors import UserError
from fedheads.flower import QUIET_ENV, require_flower

APP_NAME = "fedheads-flower"


def scripts_dir() -> Path:
    """Where Flower's console scripts are (the SuperLink and SuperNode start them by name)."""
    cands = [Path(sys.executable).parent] + [Path(p).parent / "bin" for p in sys.path if p] + \
            [Path(p) / "bin" for p in sys.path if p]
    found = shutil.which("flower-superexec")
    if found:
        cands.insert(0, Path(found).parent)
    for c in cands:
        if (c / "flower-superexec").exists() and (c / "flower-superlink").exists():
            return c
    raise UserError("flower: Flower's commands (flower-superlink, flower-superexec) are not installed; "
                    "pip install 'fedfrozen[flower]'")


def flower_env(home: Path) -> dict[str, str]:
    env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(home)}
    env["PATH"] = f"{scripts_dir()}{os.pathsep}{env.get('PATH', '')}"
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string


def node_config_arg(cfg: dict[str, Any]) -> str:
    """Flower's --node-config: space-separated key=value pairs with TOML values."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in cfg.items() if v not in (None, ""))


def write_app(app_dir: Path, run_config: dict[str, Any]) -> None:
    app_dir.mkdir(parents=True, exist_ok=True)
    lines = ["[build-system]", 'requires = ["setuptools>=64"]', 'build-backend = "setuptools.build_meta"', "",
             "[project]", f'name = "{APP_NAME}"', 'version = "1.0.0"', 'description = "fedheads over Flower"',
             'license = "Apache-2.0"', "dependencies = []", "", "[tool.flwr.app]", 'publisher = "fedfrozen"', "",
             "[tool.flwr.app.components]", 'serverapp = "fedheads.flower.server:app"',
             'clientapp = "fedheads.flower.node:app"', "", "[tool.flwr.app.config]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in run_config.items()]
    (app_dir / "pyproject.toml").write_text("\n".join(lines) + "\n")


def write_connection(home: Path, address: str, insecure: bool, root_certificates: str | None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    conn = [f"address = {json.dumps(address)}"]
    conn.append("insecure = true" if insecure else f"root-certificates = {json.dumps(str(root_certificates))}")
    (home / "config.toml").write_text('[superlink]\ndefault = "fedheads"\n\n[superlink.fedheads]\n' + "\n".join(conn) + "\n")


def wait_healthy(proc: subprocess.Popen, host: str, port: int, timeout: float, log: Path) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise UserError(f"flower: the SuperLink exited with code {proc.returncode}: "
                            f"{first_error(log)} (log: {log})")
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=2.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UserError(f"flower: the SuperLink did not answer on {host}:{port} within {timeout:.0f} s (log: {log})")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BOX_TOP, _BOX_SIDE, _BOX_BOTTOM = "\u256d", "\u2502", "\u2570"  # the rounded box Flower's CLI draws errors in


def first_error(text: str | Path, default: str = "no error message") -> str:
    """The first real error of Flower's output, as one line: the first paragraph inside its
    boxed "Error" panel (never the border), else the last line that says error/failed/exception,
    else the last non-empty line."""
    if isinstance(text, Path):
        text = text.read_text(errors="replace") if text.is_file() else ""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith(_BOX_TOP) and "Error" in ln:
            para: list[str] = []
            for body in lines[i + 1:]:
                b = body.strip()
                if b.startswith(_BOX_BOTTOM) or not b.startswith(_BOX_SIDE):
                    break
                inner = b.strip(_BOX_SIDE).strip()
                if not inner:
                    if para:
                        break
                    continue
                para.append(inner)
            if para:
                return " ".join(" ".join(para).split())[:300]
    real = [ln.strip() for ln in lines if ln.strip() and not set(ln.strip()) <= set("\u2500\u256d\u256e\u256f\u2570\u2502 -=")]
    marked = [ln for ln in real if re.search(r"error|fail|exception|refused|unavailable", ln, re.I)]
    found = (marked or real or [default])[-1]
    return " ".join(found.split())[:300]


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a process we started (by its PID), and its process group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace)


def start_superlink(home: Path, host: str, port: int, tls: dict[str, str] | None, log: Any) -> subprocess.Popen:
    """The SuperLink, its output appended to the open file `log`; it gets SIGTERM when this
    process dies (fedheads.children), so a killed `serve` frees its port."""
    require_flower()
    cmd = [str(scripts_dir() / "flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    cmd += ["--insecure"] if tls is None else ["--ssl-certfile", tls["certfile"], "--ssl-keyfile", tls["keyfile"],
                                               "--ssl-ca-certfile", tls["ca"]]
    home.mkdir(parents=True, exist_ok=True)
    return children.popen(cmd, env=flower_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def round_line(rec: dict[str, Any], rounds: int) -> str:
    """One console line per finished round (from OUT/progress.jsonl)."""
    nodes = len(rec.get("participants", []))
    dropped = list(dict.fromkeys([*(rec.get("dropped") or []), *(rec.get("eval_dropped") or [])]))
    total = int(rec.get("sent_bytes", 0)) + int(rec.get("received_bytes", 0))
    secs = float(rec.get("train_seconds", 0.0)) + float(rec.get("eval_seconds", 0.0))
    return (f"round {rec.get('round')}/{rounds}: {nodes} node{'s' if nodes != 1 else ''}"
            + (f" ({len(dropped)} dropped: {', '.join(dropped)})" if dropped else "")
            + f", {total:,} bytes, {secs:.1f} s")


class _Progress:
    """Echoes the lines the ServerApp appends to OUT/progress.jsonl, one per round, once each."""

    def __init__(self, path: Path, rounds: int, echo: Any) -> None:
        self.path, self.rounds, self.echo, self.seen = path, rounds, echo, 0

    def poll(self) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        for ln in lines[self.seen:]:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                return  # a line being written: read again on the next poll
            self.echo(round_line(rec, self.rounds))
            self.seen += 1


RUN_ATTEMPTS = 3  # `flwr run` / `flwr log` connections tried before the run is given up


def _follow_run(home: Path, log_path: Path, log: Any, deadline: float, progress: _Progress) -> None:
    """Submit the Flower App with `flwr run --stream` and follow it to its end. Flower's CLI gives
    up on a request after 30 s (a loaded machine can take longer): a submission that failed to
    connect is tried again, and a stream that broke after the run started is re-attached with
    `flwr log RUN_ID --stream`, up to RUN_ATTEMPTS times in all; every wait ends by `deadline`."""
    cmd = [str(scripts_dir() / "flwr"), "run", str(home / "app"), "fedheads", "--stream"]
    run_id = None
    for _attempt in range(RUN_ATTEMPTS):
        start = log_path.stat().st_size
        proc = children.popen(cmd, env=flower_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (home / "flwr.pid").write_text(f"{proc.pid}\n")
        try:
            while proc.poll() is None:
                progress.poll()
                if time.monotonic() > deadline:
                    raise UserError(f"flower: the run did not finish in time (log: {log_path})")
                time.sleep(0.5)
        finally:
            stop(proc)
        progress.poll()
        with open(log_path, "rb") as f:
            f.seek(start)
            said = _ANSI.sub("", f.read().decode(errors="replace"))
        found = re.search(r"Successfully started run (\d+)", said)
        run_id = found.group(1) if found else run_id
        if proc.returncode == 0 or "SuperLink is unavailable" not in said:
            return
        if run_id is None:  # the submission may have arrived all the same: never start a second run
            run_id = _submitted_run(home, log, deadline)
            if run_id == "":
                return  # cannot tell: report the first error rather than risk two runs
        if run_id is not None:  # the run goes on in the SuperLink: follow it again
            cmd = [str(scripts_dir() / "flwr"), "log", run_id, "fedheads", "--stream"]


def _submitted_run(home: Path, log: Any, deadline: float) -> str | None:
    """The id of the run this SuperLink holds (None: it holds none, "": the question failed)."""
    try:
        res = children.run([str(scripts_dir() / "flwr"), "ls", "fedheads", "--format", "json"], env=flower_env(home),
                           capture_output=True, text=True, timeout=max(1.0, min(120.0, deadline - time.monotonic())))
        runs = json.loads(res.stdout).get("runs") if res.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, AttributeError):
        runs = None
    log.write(f"flwr ls: {'failed' if runs is None else len(runs)}\n".encode())
    log.flush()
    if runs is None:
        return ""
    return str(runs[-1]["run-id"]) if runs else None


def serve(run_config: dict[str, Any], out: Path, host: str = "127.0.0.1", port: int = 0,
          tls: dict[str, str] | None = None, timeout: float = 3600.0, echo: Any = print) -> dict[str, Any]:
    """Start a SuperLink, run the federation described by `run_config`, stop the SuperLink;
    returns results.json (UserError with the server's one line when the run failed).

    The console gets one line per round; the Flower processes' own output (SuperLink and
    `flwr run`) goes to OUT/flower.log."""
    from fedheads.run import rundir

    out = Path(out)
    rundir.refuse_existing(out, overwrite=bool(run_config.get("overwrite")))  # before any process starts
    port = port or free_port(host)
    home = out.parent / f".{out.name}.flower"
    shutil.rmtree(home, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("progress.jsonl", "failed.json"):  # an earlier attempt's, never this run's
        (out / stale).unlink(missing_ok=True)
    log_path = out / "flower.log"
    deadline = time.monotonic() + timeout
    # SIGTERM (a test's timeout, a service manager) must still stop the SuperLink below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(log_path, "wb") as log:
        link = start_superlink(home, host, port, tls, log)
        (home / "superlink.pid").write_text(f"{link.pid}\n")
        try:
            wait_healthy(link, host, port, 120.0, log_path)
            echo(f"SuperLink on {host}:{port}: join with  fedheads join --superlink {host}:{port} --store ...  "
                 f"(Flower's logs: {log_path})")
            write_app(home / "app", run_config)
            write_connection(home, f"{host}:{port}", tls is None, tls["ca"] if tls else None)
            _follow_run(home, log_path, log, deadline, _Progress(out / "progress.jsonl", int(run_config.get("rounds", 1)), echo))
        finally:
            stop(link)
    if (out / "results.json").exists():
        return json.loads((out / "results.json").read_text())
    if (out / "failed.json").exists():
        raise UserError(json.loads((out / "failed.json").read_text())["error"])
    raise UserError(f"flower: the run ended without results: {first_error(log_path)} (log: {log_path})")


def join_command(superlink: str, node: dict[str, Any], home: Path, port: int = 0, insecure: bool = True,
                 root_certificates: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The SuperNode command line and environment for a node with config `node`."""
    require_flower()
    # the node's own runtime API (its ClientApp processes connect to it) stays on loopback
    cmd = [str(scripts_dir() / "flower-supernode"), "--superlink", superlink, "--host", "127.0.0.1",
           "--port", str(port or free_port()),
           "--node-config", node_config_arg(node), "--max-wait-time", "600"]
    cmd += ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    home.mkdir(parents=True, exist_ok=True)
    return cmd, flower_env(home)
