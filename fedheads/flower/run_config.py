"""What one federated run over Flower is asked to do (the Flower run config), and what the
network did (results.json `flower`). Plain data: importable without Flower."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from embedcache.errors import UserError

DROPOUT_POLICIES = ("refuse", "continue")


@dataclass(frozen=True)
class FlowerRunConfig:
    """One federated run over Flower (Flower run config keys: the field names with '-')."""

    algorithm: str = "fedncm"  # a registered algorithm (`fedheads algorithms`)
    backbones: str = ""  # comma-separated, concatenated in this order on every node
    rounds: int = 1  # communication rounds
    seed: int = 0  # run seed (participants, client initialisations, batches)
    fraction: float = 1.0  # client participation per round
    eval_every: int = 1  # evaluate every k rounds (0: only after the last)
    settings: str = "[]"  # JSON [[key, value], ...]: --set fields of the algorithm
    local_epochs: int = 0  # 0 = the algorithm's default
    batch_size: int = 0  # 0 = the algorithm's default
    lr: float = 0.0  # 0 = the algorithm's default
    binarize: bool = False  # FedPCL authors' binarised features
    secagg: bool = False  # SecAgg+ for the sum-shaped server steps (algorithms with a secure form)
    secagg_shares: float = 1.0  # SecAgg+ num_shares, fraction of the round's participants
    secagg_threshold: float = 0.67  # SecAgg+ reconstruction threshold, fraction of the shares
    nodes: int = 1  # wait for this many nodes before starting
    wait: float = 300.0  # seconds to wait for them
    timeout: float = 600.0  # seconds a round's messages may take (extraction on first use included)
    on_dropout: str = "refuse"  # "refuse" | "continue" (module docstring)
    clients: str = ""  # comma-separated client order (global indices); "" = sorted by name
    out: str = ""  # run directory written at the end ("" = none)
    overwrite: bool = False  # replace a run already in `out`
    # differential privacy (fedheads.privacy; the --dp-* options of `fedheads train`): on when
    # dp_epsilon or dp_noise_multiplier is > 0. Public parameters only: a run config reaches every
    # node, so the noise key never travels in it (each party draws its own: fedheads/flower/dp.py)
    dp_epsilon: float = 0.0  # target epsilon (0 = not given)
    dp_noise_multiplier: float = 0.0  # the noise multiplier z itself (0 = not given)
    dp_delta: float = 1e-5  # the delta epsilon is calibrated to and reported for
    dp_clip: float = 1.0  # L2 bound C of each training feature
    dp_transform: str = "clip"  # "clip" | "normalize"
    dp_mode: str = "central"  # "central": the server adds the noise | "distributed": each node adds its share
    # | "local": each node noises its own statistics (FedPFT; no SecAgg+)
    dp_accountant: str = "rdp"  # "rdp" | "pld"
    dp_split: str = ""  # FIELD=W,... budget split over the noised sums ("" = equal)

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
        from fedheads.privacy import from_cli

        return from_cli(self.dp_epsilon or None, self.dp_noise_multiplier or None, self.dp_delta, self.dp_clip,
                        self.dp_transform, self.dp_mode, self.dp_accountant, self.dp_split or None, noise_seed)

    def backbone_list(self) -> list[str]:
        return [b.strip() for b in self.backbones.split(",") if b.strip()]


@dataclass
class FlowerLog:
    """What the network did, per round (results.json `flower`)."""

    rounds: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, int] = field(default_factory=dict)  # client -> Flower node id
