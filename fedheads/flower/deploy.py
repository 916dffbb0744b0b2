"""A real Flower deployment: a SuperLink (`fedheads serve`) and SuperNodes (`fedheads join`).

`serve` starts Flower's SuperLink, writes the Flower App (a pyproject.toml naming
`fedheads.flower.server:app` and `fedheads.flower.node:app`, the run config as its defaults)
and a private Flower home (FLWR_HOME: CLI connection config, installed app bundles), submits
the run with Flower's own `flwr run`, waits for it, and stops the SuperLink by its PID. Every
Flower process gets QUIET_ENV (no telemetry, no update check, no dependency installation).
`join` runs a SuperNode with the node's own config (store, client, manifest)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
            raise UserError(f"flower: the SuperLink exited with code {proc.returncode} (log: {log})")
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=0.5).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UserError(f"flower: the SuperLink did not answer on {host}:{port} within {timeout:.0f} s (log: {log})")


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


def start_superlink(home: Path, host: str, port: int, tls: dict[str, str] | None) -> subprocess.Popen:
    require_flower()
    cmd = [str(scripts_dir() / "flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation", "--log-file", str(home / "superlink.log")]
    cmd += ["--insecure"] if tls is None else ["--ssl-certfile", tls["certfile"], "--ssl-keyfile", tls["keyfile"],
                                               "--ssl-ca-certfile", tls["ca"]]
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "superlink.out", "ab") as out:
        return subprocess.Popen(cmd, env=flower_env(home), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def serve(run_config: dict[str, Any], out: Path, host: str = "127.0.0.1", port: int = 0,
          tls: dict[str, str] | None = None, timeout: float = 3600.0, echo: Any = print) -> dict[str, Any]:
    """Start a SuperLink, run the federation described by `run_config`, stop the SuperLink;
    returns results.json (UserError with the server's one line when the run failed)."""
    port = port or free_port(host)
    home = out.parent / f".{out.name}.flower"
    shutil.rmtree(home, ignore_errors=True)
    # SIGTERM (a test's timeout, a service manager) must still stop the SuperLink below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    link = start_superlink(home, host, port, tls)
    (home / "superlink.pid").write_text(f"{link.pid}\n")
    try:
        wait_healthy(link, host, port, 60.0, home / "superlink.log")
        echo(f"SuperLink on {host}:{port}: join with  fedheads join --superlink {host}:{port} --store ...")
        write_app(home / "app", run_config)
        write_connection(home, f"{host}:{port}", tls is None, tls["ca"] if tls else None)
        cmd = [str(scripts_dir() / "flwr"), "run", str(home / "app"), "fedheads", "--stream"]
        with open(home / "run.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=flower_env(home), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                raise UserError(f"flower: the run did not finish within {timeout:.0f} s (log: {home / 'run.log'})") from None
    finally:
        stop(link)
    if (out / "results.json").exists():
        return json.loads((out / "results.json").read_text())
    if (out / "failed.json").exists():
        raise UserError(json.loads((out / "failed.json").read_text())["error"])
    tail = (home / "run.log").read_text(errors="replace").strip().splitlines()[-1:] if (home / "run.log").exists() else []
    raise UserError(f"flower: the run ended without results ({' '.join(tail)[:200]}; log: {home / 'run.log'})")


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
