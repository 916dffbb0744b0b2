"""Differential privacy over Flower: the `fedheads.privacy.Private` wrapper split between the
server and the nodes, the same mechanism as `fedheads train --dp-*` (that module's docstring).

Who does what in a round:
- every node clips (or normalizes) its own training features to the public bound C before it
  forms its sums (Private.client_update on the node, M=1);
- "distributed": every participant adds its share N(0, sigma_f^2 / K) to its own sums, drawn
  from a key only the node holds; the server adds none;
- "central": the server adds N(0, sigma_f^2) to the round's totals (after SecAgg+ when it is on)
  from its own key, then finalizes;
- "local" (FedPFT): every node adds N(0, sigma_f^2) to its own statistics and sends the message
  built from them; the server adds none (no SecAgg+: the messages are no sums).

What travels (fh.run, the run config): the PUBLIC parameters only (C, the transform, the mode,
the resolved noise multiplier z, the budget split, and the per-field noise scales the node must
arrive at): never a noise key. A node draws its own secret key from the OS; in simulation
(`fedheads simulate --dp-noise-seed`, tests) the harness gives each virtual node the seed in its
node config, so that a run equals the engine's. A node whose noise scales differ from the
server's (another fedheads version: another sensitivity) refuses the round in one line.

Accounting: each node reports, in the clear beside its update, how many rounds it has sent
non-zero statistics in (`fh.releases`, an integer per round; it follows from its participation and
whether it holds training data, which the server already learns); the server keeps the last count
per client and reports the maximum, as the engine does from the client states."""

from __future__ import annotations

import json
from typing import Any

from embedcache.errors import UserError

RELEASES = "fh.releases"  # config record of a train.update reply: {"releases": int}


def node_mechanism(alg: Any) -> dict[str, Any] | None:
    """What the nodes need of the server's Private `alg` (None: no DP): public parameters only."""
    from fedheads.privacy import Private

    if not isinstance(alg, Private):
        return None
    m = alg.mech
    return {"clip": m.clip, "transform": m.transform, "mode": m.mode, "noise_multiplier": alg.z,
            "split": [[k, w] for k, w in m.split], "noise_std": dict(alg.noise_std)}


def node_algorithm(inner: Any, dp: dict[str, Any] | None, noise_seed: int | None, who: str) -> Any:
    """The node's algorithm: `inner`, or `inner` under the run's mechanism with the node's own
    noise key (`noise_seed` None: a secret one from the OS)."""
    if dp is None:
        return inner
    from fedheads.privacy import Mechanism, Private

    mech = Mechanism(clip=float(dp["clip"]), transform=str(dp["transform"]), mode=str(dp["mode"]),
                     noise_multiplier=float(dp["noise_multiplier"]),
                     split=tuple((str(k), float(w)) for k, w in dp["split"]), noise_seed=noise_seed)
    alg = Private(inner, mech)  # an algorithm without a DP form: its own one line
    want = {k: float(v) for k, v in dp["noise_std"].items()}
    if alg.noise_std != want:
        raise UserError(f"node {who}: its DP noise scales {json.dumps(alg.noise_std, sort_keys=True)} differ from "
                        f"the server's {json.dumps(want, sort_keys=True)} (another fedheads version?)")
    return alg


def node_noise_seed(node_config: dict[str, str]) -> int | None:
    """The node config's `dp-noise-seed` (simulation and tests only; a deployment's nodes have none)."""
    value = node_config.get("dp-noise-seed", "")
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"node config: dp-noise-seed {value!r}: expected an integer") from None


def releases_of(client_state: Any) -> int:
    """A node's count of rounds with non-zero statistics (its Private client state, M=1)."""
    return int(client_state.releases.max()) if client_state.releases.numel() else 0


def reported_releases(reply_configs: Any, who: str) -> int:
    """The release count a node's train.update reply carries (one line when it is missing)."""
    rec = reply_configs.get(RELEASES)
    if rec is None or "releases" not in rec:
        raise UserError(f"node {who}: its update carries no DP release count (another fedheads version?)")
    return int(rec["releases"])
