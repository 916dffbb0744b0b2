"""What one federated run over Flower is asked to do (the Flower run config), and what the
network did (results.json `flower`). Plain data: importable without Flower."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from embedcache.errors import UserError
from fedheads.core.config import setting
from fedheads.privacy_accounting import Mechanism
from fedheads.run import commands

DROPOUT_POLICIES = ("refuse", "continue")


def _dp(name: str, default: Any) -> Any:
    """A dp_* field of the run config: the --dp-* option of `fedheads train` (its doc), 0 or "" for
    "not given" (a Flower run config holds no None)."""
    f = next(f for f in fields(Mechanism) if f.name == name)
    return setting(default, str(f.metadata["doc"]) + (" (0: not given)" if default == 0.0 and f.default is None else ""),
                   choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"))


@dataclass(frozen=True)
class FlowerRunConfig:
    """One federated run over Flower: the options of `fedheads simulate` / `serve` (Flower run
    config keys: the field names with '-'). Flat and TOML-typed: 0 and "" mean "not given"."""

    algorithm: str = setting("fedncm", "see `fedheads algorithms`", required=True)
    backbones: str = setting("", "comma-separated; every node concatenates them in this order", required=True,
                             metavar="B,...")
    rounds: int = commands.rounds(1)
    seed: int = setting(0, "run seed (participants, client initialisations, batches)")
    fraction: float = commands.fraction()
    eval_every: int = commands.eval_every()
    settings: str = setting("[]", "algorithm config field (repeatable; the run config holds them as JSON [[key, "
                            "value], ...])", name="set", multiple=True, metavar="KEY=VALUE")
    local_epochs: int = setting(0, "local epochs E (0: the algorithm's paper default)")
    batch_size: int = setting(0, "local batch size (0: the paper's)")
    lr: float = setting(0.0, "client learning rate (0: the paper's)")
    binarize: bool = setting(False, "FedPCL authors' 0/1 binarised backbone features")
    secagg: bool = setting(False, "SecAgg+ for the sum-shaped server steps (algorithms with a secure form)")
    secagg_shares: float = setting(1.0, "SecAgg+ shares, fraction of the round's participants")
    secagg_threshold: float = setting(0.67, "SecAgg+ reconstruction threshold, fraction of the shares")
    nodes: int = setting(1, "wait for this many SuperNodes (fedheads join), then run")
    wait: float = setting(600.0, "seconds to wait for the nodes")
    timeout: float = setting(600.0, "seconds a round's messages may take (extraction on first use included)")
    on_dropout: str = setting("refuse", "a node failing a round: stop the run (refuse), or complete the round from the "
                              "others (continue, recorded)", choices=DROPOUT_POLICIES)
    clients: str = setting("", "comma-separated client order (global indices; default: sorted by name)")
    out: str = setting("", "run directory written at the end", required=True)
    overwrite: bool = commands.overwrite()
    # differential privacy (fedheads.privacy; the --dp-* options of `fedheads train`): on when
    # dp_epsilon or dp_noise_multiplier is > 0. Public parameters only: a run config reaches every
    # node, so the noise key never travels in it (each party draws its own: fedheads/flower/dp.py)
    dp_epsilon: float = _dp("epsilon", 0.0)
    dp_noise_multiplier: float = _dp("noise_multiplier", 0.0)
    dp_delta: float = _dp("delta", 1e-5)
    dp_clip: float = _dp("clip", 1.0)
    dp_transform: str = _dp("transform", "clip")
    dp_mode: str = _dp("mode", "central")
    dp_accountant: str = _dp("accountant", "rdp")
    dp_split: str = _dp("split", "")

    def __post_init__(self) -> None:
        if self.on_dropout not in DROPOUT_POLICIES:
            raise UserError(f"on-dropout {self.on_dropout!r}: must be one of {', '.join(DROPOUT_POLICIES)}")
        if self.rounds < 1 or self.nodes < 1:
            raise UserError(f"rounds {self.rounds} / nodes {self.nodes}: must be >= 1")
        if not self.backbones:
            raise UserError("backbones: at least one is needed")
        for name in ("dp_epsilon", "dp_noise_multiplier"):
            if not getattr(self, name) >= 0:  # 0 means "not given": a negative one must not mean it silently
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be a positive number")
        if self.mechanism() is not None and self.dp_mode == "distributed" and self.on_dropout == "continue":
            raise UserError("--dp-mode distributed with --on-dropout continue: a dropped node's noise share would be "
                            "missing from the round's sum (less noise than accounted); use --dp-mode central or "
                            "--on-dropout refuse")

    @classmethod
    def from_run_config(cls, rc: Any) -> FlowerRunConfig:
        known = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in dict(rc).items():
            name = str(key).replace("-", "_")
            if name in known:
                kw[name] = type(known[name].default)(value)  # TOML ints where floats are meant
        return cls(**kw)

    def to_run_config(self) -> dict[str, Any]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    def mechanism(self, noise_seed: int | None = None) -> Any:
        """The fedheads.privacy.Mechanism the dp_* fields ask for (None: no DP). `noise_seed`
        (simulation only) is never a field: it would travel to the nodes with the run config."""
        if self.dp_epsilon <= 0 and self.dp_noise_multiplier <= 0:
            return None
        from fedheads.run.options import coerce, options_of

        split = coerce(options_of(Mechanism)["split"], self.dp_split, "--dp-split ")
        return Mechanism(clip=self.dp_clip, transform=self.dp_transform, noise_multiplier=self.dp_noise_multiplier or None,
                         epsilon=self.dp_epsilon or None, delta=self.dp_delta, mode=self.dp_mode,
                         accountant=self.dp_accountant, split=split, noise_seed=noise_seed)

    def backbone_list(self) -> list[str]:
        return [b.strip() for b in self.backbones.split(",") if b.strip()]


@dataclass
class FlowerLog:
    """What the network did, per round (results.json `flower`)."""

    rounds: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, int] = field(default_factory=dict)  # client -> Flower node id


@dataclass(frozen=True)
class Simulate:
    """`fedheads simulate`: an algorithm over Flower's simulation runtime in this process (the results of `train`)."""

    store: str | None = commands.store("feature store; one virtual node per client")
    run: FlowerRunConfig = setting(default_factory=FlowerRunConfig, nested=FlowerRunConfig, inline=True,
                                   skip=("nodes", "wait"))
    dp_noise_seed: int | None = setting(None, "reproducible noise (simulation only; default: a secret key from the OS)")


@dataclass(frozen=True)
class Serve:
    """`fedheads serve`: a Flower SuperLink; an algorithm over the nodes that join (`fedheads join`)."""

    host: str = setting("127.0.0.1", "address the SuperLink binds (loopback for a local trial)")
    port: int = setting(0, "SuperLink port (default: a free one, printed)")
    ssl_certfile: str | None = setting(None, "TLS certificate (a real deployment; else --insecure is used)")
    ssl_keyfile: str | None = setting(None, "TLS private key")
    ssl_ca_certfile: str | None = setting(None, "TLS CA certificate (give it to the nodes as --root-certificates)")
    run: FlowerRunConfig = setting(default_factory=FlowerRunConfig, nested=FlowerRunConfig, inline=True,
                                   skip=("clients",))

    retired: ClassVar[dict[str, str]] = {"dp_noise_seed": "simulation only (`fedheads simulate`); in a deployment the "
                                         "server and every node draw their own secret noise key"}


@dataclass(frozen=True)
class Join:
    """`fedheads join`: a Flower SuperNode for this node's own data, until the SuperLink goes away."""

    superlink: str = setting("", "HOST:PORT of the SuperLink (`fedheads serve` prints it)", required=True)
    store: str | None = commands.store("this node's own feature store")
    client: str = setting("", "which client of the store / manifest this node is (default: the only one)")
    manifest: str = setting("", "this node's images: extracted into --store on first use")
    device: str = commands.device("cpu")
    weights_dir: str = setting("", "backbone weights for the extraction")
    port: int = setting(0, "local port of the node's ClientApp API (default: a free one)")
    root_certificates: str | None = setting(None, "CA certificate of a TLS SuperLink (default: insecure)")
    log: str = setting("", "where the SuperNode's output goes (default: STORE.flower.log beside the store; '-': this "
                       "console)")
