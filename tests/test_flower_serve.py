"""`fedheads serve`'s own handling of Flower's processes, against a stand-in SuperLink (a small HTTP
server that answers /health and drops every other request) and Flower's real `flwr` command: a
failed `flwr run` is reported by its cause (the text inside Flower's boxed error, never its border),
and the Flower processes' output goes to OUT/flower.log, not the console. Everything binds
127.0.0.1; the stand-in is stopped by its PID."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from flower_helpers import FLOWER_MISSING

pytest.importorskip("flwr", reason=FLOWER_MISSING)

from embedcache.errors import UserError  # noqa: E402
from fedheads.flower import deploy  # noqa: E402

STAND_IN = """#!{python}
import http.server, sys
a = sys.argv[1:]
host, port = a[a.index("--host") + 1], int(a[a.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        pass  # no response: the client sees the connection dropped
    def log_message(self, *a):
        print("stand-in:", *a, flush=True)
print("stand-in SuperLink up", flush=True)
http.server.HTTPServer((host, port), H).serve_forever()
"""

BOX = """\
Using SuperLink: fedheads (127.0.0.1:9)
\u256d\u2500 Error \u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u256e
\u2502 Connection to the SuperLink is unavailable. Please     \u2502
\u2502 check your network connection and 'address' in the   \u2502
\u2502 SuperLink connection configuration.                  \u2502
\u2502                                                      \u2502
\u2502 a second paragraph                                   \u2502
\u2570\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u256f
"""


def test_first_error_reads_inside_the_box():
    assert deploy.first_error(BOX) == ("Connection to the SuperLink is unavailable. Please check your network "
                                       "connection and 'address' in the SuperLink connection configuration.")
    assert deploy.first_error("\x1b[91mERROR \x1b[0m: the ServerApp failed\n\u2570\u2500\u2500\u256f\n") == \
        "ERROR : the ServerApp failed"
    assert deploy.first_error("") == "no error message"


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Flower's scripts directory with the stand-in SuperLink and the real `flwr`."""
    real = deploy.scripts_dir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    link = bin_dir / "flower-superlink"
    link.write_text(STAND_IN.format(python=sys.executable))
    link.chmod(0o755)
    (bin_dir / "flwr").symlink_to(real / "flwr")
    monkeypatch.setattr(deploy, "scripts_dir", lambda: bin_dir)
    monkeypatch.setattr(deploy, "RUN_ATTEMPTS", 2, raising=False)
    handler = signal.getsignal(signal.SIGTERM)  # serve sets its own
    yield bin_dir
    signal.signal(signal.SIGTERM, handler)


def test_a_failed_flwr_run_is_reported_by_its_cause_and_logged_to_the_run_dir(tmp_path, stand_in):
    out = tmp_path / "run"
    said: list[str] = []
    cfg = {"algorithm": "fedncm", "backbones": "synth", "rounds": 1, "nodes": 1, "out": str(out)}
    with pytest.raises(UserError) as err:
        deploy.serve(cfg, out, timeout=300, echo=said.append)
    msg = str(err.value)
    assert "Connection to the SuperLink is unavailable" in msg, msg
    assert "\u2570" not in msg and "\u2500" not in msg and str(out / "flower.log") in msg
    log = (out / "flower.log").read_text()
    assert "stand-in SuperLink up" in log and "flwr ls: failed" in log  # no second submission without knowing
    assert len(said) == 1 and said[0].startswith("SuperLink on 127.0.0.1:")  # nothing else on the console
    pid = int((tmp_path / ".run.flower" / "superlink.pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # stopped (and reaped) by serve


def test_join_sends_the_supernode_output_to_its_log_and_says_one_line(tmp_path):
    """A node with no SuperLink to reach retries (Flower's backoff): into STORE.flower.log, not the console."""
    import subprocess
    import time

    from fedheads import children
    from fedheads.flower.deploy import free_port, stop

    store, log = tmp_path / "node" / "c0.zarr", tmp_path / "node" / "c0.zarr.flower.log"
    cmd = [sys.executable, "-m", "fedheads.cli", "join", "--superlink", f"127.0.0.1:{free_port()}", "--store", str(store)]
    proc = children.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240  # a SuperNode start on a loaded 2-core machine
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and "retrying" in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        assert proc.poll() is None and "retrying" in log.read_text(errors="replace"), \
            f"no connection retry logged within 240 s (exit code {proc.poll()})"
    finally:
        stop(proc)
        _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("joining 127.0.0.1:") and str(log) in lines[0], lines
