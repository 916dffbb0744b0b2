"""What `fedheads simulate`, `serve` and `join` do with their declared options
(fedheads.run.commands: Simulate, Serve, Join): the checks before anything starts, the run,
and the one line the command prints."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from fedheads.run.commands import Join, Serve, Simulate


def checked(cmd: Any, given: Callable[[str], bool]) -> Any:
    """The options of a Flower run, checked before any server starts: the algorithm name, a given
    --dp-epsilon / --dp-noise-multiplier (0 means "not given" in a run config), the extra, an
    algorithm without a DP form under --dp-*; the run directory made absolute. `given(key)`: the
    option was given (not its default)."""
    from fedheads.run.checks import check_algorithms

    check_algorithms([cmd.run.algorithm])
    for k in ("dp_epsilon", "dp_noise_multiplier"):
        if given(k) and not getattr(cmd.run, k) > 0:
            raise UserError(f"--{k.replace('_', '-')} {getattr(cmd.run, k)}: must be a positive number")
    from fedheads.flower import require_flower

    require_flower()  # one line without the extra, before anything is written
    cmd = dataclasses.replace(cmd, run=dataclasses.replace(cmd.run, out=str(Path(cmd.run.out).resolve())))
    if cmd.run.mechanism() is not None:
        from fedheads.flower.loop import build

        build(cmd.run)  # the server's algorithm under the mechanism: refuses one without a DP form
    return cmd


def summary(res: dict[str, Any], out: str) -> str:
    """One line; the node count is that of the accuracy mean (nodes evaluated), dropped ones named."""
    fl = res.get("flower", {})
    over = sum(1 for v in res.get("per_client", {}).values() if v.get("mean") is not None)
    dropped = res.get("clients_dropped") or []
    return (f"{res['algorithm']} over Flower ({res['engine']}): accuracy {res['accuracy_cell']} over {over} of "
            f"{len(fl.get('nodes', {}))} nodes" + (f" ({', '.join(dropped)} dropped)" if dropped else "")
            + f", {fl.get('sent_bytes', 0) + fl.get('received_bytes', 0):,} bytes -> {out}/results.json")


def simulate(cmd: Simulate, echo: Callable[[str], None]) -> str:
    """The run over Flower's simulation runtime in this process; its summary line."""
    from fedheads.flower.sim import flower_logs, simulate_store
    from fedheads.run import rundir

    out = Path(cmd.run.out)
    with rundir.locked(out):  # one run writes --out at a time, as for `train`
        rundir.refuse_existing(out, overwrite=cmd.run.overwrite)  # before flower.log: a run there is left untouched
        with flower_logs(out / "flower.log", echo):
            simulate_store(cmd.run, cmd.store, [c for c in cmd.run.clients.split(",") if c] or None,
                           noise_seed=cmd.dp_noise_seed)
    return summary(json.loads((out / "results.json").read_text()), cmd.run.out)


def serve(cmd: Serve, echo: Callable[[str], None]) -> str:
    """A SuperLink, the run over the nodes that join, the run directory; its summary line."""
    cfg = cmd.run
    if cfg.dp_mode == "distributed" and not cfg.secagg and cfg.mechanism() is not None:
        echo("note: --dp-mode distributed without --secagg: the server sees each node's sums with only its share of "
             "the noise (docs/flower.md)")
    tls = {"certfile": cmd.ssl_certfile, "keyfile": cmd.ssl_keyfile, "ca": cmd.ssl_ca_certfile}
    if any(tls.values()) and not all(tls.values()):
        raise UserError("--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile: give all three (or none: insecure)")
    from fedheads.flower.deploy import serve as run_serve
    from fedheads.run import rundir

    with rundir.locked(Path(cfg.out)):  # one run writes --out at a time, as for `train`
        res = run_serve(cfg.to_run_config(), Path(cfg.out), host=cmd.host, port=cmd.port,
                        tls=tls if all(tls.values()) else None, timeout=cfg.wait + cfg.timeout * (cfg.rounds + 2),
                        echo=echo)
    return summary(res, cfg.out)


def join(j: Join, echo: Callable[[str], None]) -> None:
    """Become this node's SuperNode (the process is replaced: signals reach it directly); its
    connection retries and per-message lines go to --log."""
    from fedheads.flower.deploy import join_command

    store = Path(j.store).resolve()
    node = {"store": str(store), "client": j.client, "device": j.device,
            "manifest": str(Path(j.manifest).resolve()) if j.manifest else "", "weights-dir": j.weights_dir}
    cmd, env = join_command(j.superlink, node, store.parent / f".{store.name}.flower", j.port,
                            insecure=j.root_certificates is None, root_certificates=j.root_certificates)
    store.parent.mkdir(parents=True, exist_ok=True)
    log = None if j.log == "-" else Path(j.log or store.with_name(store.name + ".flower.log"))
    echo(f"joining {j.superlink} as {j.client or store.name} (SuperNode, this PID" + (f"; its log: {log})" if log else ")"))
    if log is not None:
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise UserError(f"--log {log}: cannot write it ({exc.strerror or exc}); give another --log") from None
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execve(cmd[0], cmd, env)
