"""fedheads over Flower: the algorithms of `fedheads.algorithms`, unchanged, as a
Flower ServerApp / ClientApp, each client node caching its own features with embedcache.

Layout (docs/contracts.md section 8 is the contract):
- `codec`   stacked trees (client state, server state, broadcast, messages) <-> Flower records;
- `secure`  which message fields are sums, their SecAgg+ quantisation, and the server step on
            the securely summed totals;
- `node`    the ClientApp (`fedheads.flower.node:app`): a node's own data, extraction on first use,
            client state in `context.state`;
- `dp`      differential privacy (fedheads.privacy's Private) split between the server and the
            nodes: what travels (never a noise key), who adds the noise, the release counts;
- `server`  the ServerApp (`fedheads.flower.server:app`): M=1 messages in, the same
            `server_aggregate` out;
- `sim`     Flower's simulation runtime (LinkState, InMemoryGrid, VCE workers) with an in-process
            backend, for development and the equality tests;
- `deploy`  a SuperLink and SuperNodes on loopback (`fedheads serve` / `fedheads join`).

Flower is an optional extra (`pip install 'fedfrozen[flower]'`); nothing outside this package
imports it, and importing this package sets Flower's offline switches (QUIET_ENV) BEFORE any
Flower module is imported (its telemetry flag is read at import time)."""

from __future__ import annotations

import os

from embedcache.errors import UserError

# Every switch that makes Flower 1.41 reach the network, found in its source:
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",  # flwr/supercore/telemetry.py: events are POSTed unless "0"
    "FLWR_TELEMETRY_LOGGING": "0",  # ... and not even logged
    "FLWR_DISABLE_UPDATE_CHECK": "1",  # flwr/supercore/update_check.py: no request to the update API
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # SuperLink default: no `uv sync` of app deps
    "FLWR_TRACING_ENABLED": "0",  # flwr/supercore/tracing.py: no trace export backend
}
FLOWER_VERSION = "1.41.0"  # the release pinned by the [flower] extra


def quiet_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """Apply QUIET_ENV to `env` (default: this process's os.environ) and return it."""
    target = os.environ if env is None else env
    target.update(QUIET_ENV)
    return target  # type: ignore[return-value]


quiet_environment()


def require_flower() -> None:
    """One clear line when the optional extra is missing or is another release."""
    try:
        from importlib.metadata import version

        import flwr  # noqa: F401
    except ImportError:
        raise UserError("flower: not installed; install the extra: pip install 'fedfrozen[flower]'") from None
    found = version("flwr")
    if found != FLOWER_VERSION:
        raise UserError(f"flower: flwr {found} is installed, fedheads.flower needs {FLOWER_VERSION} "
                        "(pip install 'fedfrozen[flower]')")
