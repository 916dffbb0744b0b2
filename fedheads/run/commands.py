"""Every command's options, declared once: one frozen dataclass per command, every field declared
with fedheads.core.config.setting. The command line, config files, the Python API's keywords
and the documentation are generated from these (fedheads.run.options); the runners take them.

The options several commands share are declared once, here, and mean the same in each:
`seeds`, `rounds`, `eval_every`, `fraction`, `device`, `out`, `overwrite`, `resume`, `progress`
(--quiet), `settings` (--set), `num_workers`, `weights_dir`. A command's own inputs (store,
backbones, manifest, ...) come first; `Train` and `Compare` share the `TrainOptions` they train with.

No torch: the command line builds its options, and refuses bad ones, before torch loads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from embedcache.errors import UserError
from fedheads.core.config import setting
from fedheads.core.schedule import evaluated
from fedheads.privacy_accounting import Mechanism

# ------------------------------------------------------------------ the options every command shares


def seeds(default: tuple[int, ...]) -> Any:
    return setting(default, "seeds, one run each (reports give the mean (std) over them)", metavar="S,...")


def rounds(default: int | None, doc: str = "communication rounds", source: str = "") -> Any:
    return setting(default, doc, source=source)


def eval_every() -> Any:
    return setting(1, "evaluate every k rounds and after the last (0: after the last only); finetune and feddra also "
                      "evaluate the model they start from, as round 0")


class Schedule:
    """When a command that trains for rounds evaluates (its `eval_every`, one rule for every driver:
    fedheads.core.schedule); the drivers take `evaluates`, never the option itself."""

    eval_every: int

    def evaluates(self, r: int, rounds: int) -> bool:
        return evaluated(r, rounds, self.eval_every)

    def check_schedule(self) -> None:
        if self.eval_every < 0:
            raise UserError(f"--eval-every {self.eval_every}: must be >= 0 (0: after the last round only)")


def fraction() -> Any:
    return setting(1.0, "client participation per round")


def device(default: str = "auto") -> Any:
    return setting(default, "where it computes: auto | cpu | cuda | cuda:N")


def out(doc: str = "the run directory") -> Any:
    return setting(None, doc, required=True)


def overwrite() -> Any:
    return setting(False, "replace the run already in --out (its files only; default: refuse)", operational=True)


def resume() -> Any:
    return setting(False, "continue the interrupted run in --out from its per-round checkpoints (same settings)",
                   operational=True)


def progress() -> Any:
    return setting(True, "progress bars", name="quiet", negate=True, operational=True)


def method_settings(doc: str) -> Any:
    return setting((), doc + " (repeatable)", name="set", multiple=True, metavar="KEY=VALUE")


def num_workers() -> Any:
    return setting(2, "image decoding workers (live images)")


def weights_dir() -> Any:
    return setting(None, "where backbone weights are looked up first")


def store(doc: str = "feature store (embedcache extract)", required: bool = True) -> Any:
    return setting(None, doc, required=required)


def backbones() -> Any:
    return setting((), "backbones, features concatenated in this order", required=True, metavar="B,...")


def num_classes() -> Any:
    return setting(None, "numpy arrays: classes 0..C-1 (default: the largest label + 1)", cli=False)


def all_rounds() -> Any:
    return setting(False, "one-pass heads (FedNCM, Fed3R, FedCOF, FedPFT) with every client in every round: train "
                   "and evaluate all `rounds` (the same head each round) instead of the one round they need (the "
                   "per-round histories the pipelines' cells have always recorded)", cli=False)


# ------------------------------------------------------------------ train, compare
@dataclass(frozen=True)
class TrainOptions(Schedule):
    """How `fedheads train` / `compare` train (besides the store, the algorithms and the output)."""

    rounds: int = rounds(50, source="FedPCL trains 50-200")
    seeds: tuple[int, ...] = seeds((0, 1, 2))
    fraction: float = fraction()
    engine: str = setting("vectorized", "vectorized (all clients stacked) | loop (the reference)",
                          choices=("vectorized", "loop"))
    layout: str = setting("auto", "features padded to the largest client, or in size buckets (auto: when padding "
                          "would cost; streamed when they would take over half the memory available); streamed: "
                          "buckets read from the store as each round needs them (memory for one bucket)",
                          choices=("auto", "padded", "bucketed", "streamed"))
    device: str = device()
    eval_every: int = eval_every()
    binarize: bool = setting(False, "FedPCL authors' 0/1 binarised backbone features")
    local_epochs: int | None = setting(None, "local epochs E (default: the algorithm's paper default)")
    batch_size: int | None = setting(None, "local batch size (default: the paper's)")
    lr: float | None = setting(None, "client learning rate (default: the paper's)")
    settings: tuple[tuple[str, Any], ...] = method_settings(
        "algorithm config field, e.g. --set variant=code, or --set lp.lr=0.1 for one algorithm")
    progress: bool = progress()
    tensorboard: bool = setting(False, "per-round scalars per seed in OUT/tensorboard/ (extra [tensorboard])")
    dp: Any = setting(None, "train under differential privacy (fedheads.privacy)", nested="dp", prefix="dp")

    generic_names = ("local_epochs", "batch_size", "lr")  # options that set the algorithm config field of that name

    def __post_init__(self) -> None:
        from fedheads.run.checks import check_finite, check_seeds

        check_seeds(self.seeds)
        check_finite(self)
        self.check_schedule()
        if self.rounds < 1:
            raise UserError(f"--rounds {self.rounds}: must be >= 1")
        if self.layout == "streamed" and self.engine != "vectorized":  # refused before a run directory is touched
            raise UserError(f"layout streamed: the {self.engine} engine takes one client per call and would read a "
                            "whole bucket for each; use layout bucketed (or the vectorized engine)")

    def generic(self) -> dict[str, Any]:
        g = {"local_epochs": self.local_epochs, "batch_size": self.batch_size, "lr": self.lr}
        return {k: v for k, v in g.items() if v is not None}


@dataclass(frozen=True)
class Train:
    """`fedheads train`: one algorithm over several seeds."""

    store: str | None = store()
    backbones: tuple[str, ...] = backbones()
    algorithm: str = setting("", "see `fedheads algorithms`", required=True)
    options: TrainOptions = setting(default_factory=TrainOptions, nested=TrainOptions, inline=True)
    num_classes: int | None = num_classes()
    all_rounds: bool = all_rounds()
    out: str | None = out()
    overwrite: bool = overwrite()
    resume: bool = resume()


@dataclass(frozen=True)
class Compare:
    """`fedheads compare`: several algorithms on the same features."""

    store: str | None = store()
    backbones: tuple[str, ...] = backbones()
    algorithms: tuple[str, ...] = setting((), "e.g. fedpcl,fedncm,lp,mlp,fedavg,fedproto", required=True,
                                          metavar="A,...")
    options: TrainOptions = setting(default_factory=TrainOptions, nested=TrainOptions, inline=True)
    num_classes: int | None = num_classes()
    all_rounds: bool = all_rounds()
    out: str | None = out("the comparison's directory (one run directory per algorithm, the table and plots)")
    overwrite: bool = overwrite()
    resume: bool = resume()


# ------------------------------------------------------------------ predict
@dataclass(frozen=True)
class Predict:
    """`fedheads predict`: classify samples with a trained run."""

    run: str | None = setting(None, "a `fedheads train` run directory", required=True)
    store: str | None = store("features already extracted (one of --store / --manifest / --images)", False)
    manifest: Any = setting(None, "a manifest: its --split, each sample by its own client")
    images: str | None = setting(None, "new images, imagefolder:PATH; folders named like the run's classes give labels "
                                 "(and accuracy); classified by the global model, or --client", metavar="imagefolder:PATH")
    cache: str | None = setting(None, "feature store for new images (default RUN_DIR/predict-cache)")
    split: str | None = setting(None, "--store / --manifest: the split (default: test)", choices=("train", "test"))
    client: str | None = setting(None, "a client name, or all (default: all; --images: the global model)")
    seed: int | None = setting(None, "which seed's state (default: the run's first)")
    top_k: int = setting(1, "also write the k nearest classes (capped at the classes)")
    chunk_rows: int = setting(65536, "rows per streamed chunk (bounded memory)")
    device: str = device("cpu")
    batch_size: int | None = setting(None, "extraction batch (default: the training store's)")
    num_workers: int = num_workers()
    weights_dir: str | None = weights_dir()
    plugins: tuple[str, ...] = setting((), "module to import first (registers custom backbones)", name="plugin",
                                       multiple=True, metavar="MODULE")
    progress: bool = progress()
    out: str | None = setting(None, "a .csv or .parquet file (required on the command line; the API returns the "
                              "table without it)", required=True)


# ------------------------------------------------------------------ finetune
@dataclass(frozen=True)
class FinetuneRun(Schedule):
    """How `fedheads finetune` runs; its method settings (optimisers, which blocks train, BatchNorm,
    augmentation) are --set keys: fedheads.finetuning.runner.SETTINGS."""

    heads: tuple[str, ...] = setting(("fedncm",), "stage 1, comma-separated for a comparison: fedncm (FedNCM+FT) | "
                                     "fed3r (Fed3R+FT) | fedcof (FedCOF+FT) | lp (LP+FT) | random (FT) | any algorithm "
                                     "whose state is a linear head (fedheads algorithms)", name="head",
                                     metavar="H,...")
    rounds: int = rounds(10, "fine-tuning rounds")
    fraction: float = fraction()
    settings: tuple[tuple[str, Any], ...] = method_settings(
        "method setting, e.g. --set server=fedadam --set lr=0.01 --set trainable=after:layer2 (--list-settings "
        "describes every key, --dump-config gives their values)")
    seeds: tuple[int, ...] = seeds((0,))
    eval_every: int = eval_every()
    device: str = device()
    num_workers: int = num_workers()
    weights_dir: str | None = weights_dir()
    resume: bool = resume()
    overwrite: bool = overwrite()
    progress: bool = progress()


@dataclass(frozen=True)
class Finetune:
    """`fedheads finetune`: fine-tune a backbone federatedly from a stage-1 head computed on the store."""

    manifest: Any = setting(None, "the manifest the store was extracted from", required=True)
    store: str | None = store("feature store with the backbone's features (and B@CUT maps)")
    backbone: str = setting("", "trainable backbone, e.g. resnet20-cifar10 (see `embedcache backbones`)",
                            required=True)
    run: FinetuneRun = setting(default_factory=FinetuneRun, nested=FinetuneRun, inline=True)
    out: str | None = out()

    # options that became --set keys, {former option: (--set key, the value a flag stood for or None)}: refused
    # in one line naming the replacement, on the command line, in a --config file and as API keywords
    retired: ClassVar[dict[str, tuple[str, Any]]] = {
        **{k: (k, None) for k in ("head_rounds", "server", "server_lr", "server_momentum", "server_buffers", "prox_mu",
                                  "lr", "warmup_rounds", "momentum", "weight_decay", "local_epochs", "batch_size",
                                  "trainable", "bn")},
        "live_prefix": ("live_prefix", True), "no_pretrained": ("pretrained", False), "no_augment": ("augment", False)}


# ------------------------------------------------------------------ feddra
@dataclass(frozen=True)
class FedDRARun(Schedule):
    """How `fedheads feddra` runs; FedDRA's own settings (objective, schedule, DRO, optimisation,
    which encoder blocks train) are --set keys: fedheads.alignment.runner.SETTINGS."""

    baselines: tuple[str, ...] = setting(("feddra",), "comma-separated presets: feddra, fedavg (the paper's: one "
                                         "stage), fedavg-two-stage, fedprox, no-two-stage, no-constraint, no-dro",
                                         name="baseline", metavar="B,...")
    preset: str = setting("paper", "defaults of the settings not given: paper (25 rounds x 50 steps, both encoders "
                          "train) or quick (4 rounds x 5 steps at batch 32, text encoder frozen: minutes on 2 CPU "
                          "cores)", choices=("paper", "quick"))
    image_cut: str | None = setting(None, "image token states after this stage (default: its last map; Lite0 blocks.6)")
    text_cut: str | None = setting(None, "text token states after this stage (default: its last layer, layer.5)")
    rounds: int | None = rounds(None, "communication rounds (default: the preset's; paper: 25)",
                                source="FedDRA App. A.1")
    settings: tuple[tuple[str, Any], ...] = method_settings(
        "method setting, e.g. --set rho=0.1 --set mu=1 --set steps=50 --set schedule=sequential (--list-settings "
        "describes every key, --dump-config gives their values)")
    probe_manifest: str | None = setting(None, "out-of-distribution manifest for the few-shot probe")
    probe_shots: tuple[int, ...] = setting((1, 5), "labelled images per class of the probe", metavar="K,...")
    probe_draws: int = setting(5, "seeded draws per k of the probe")
    seeds: tuple[int, ...] = seeds((0,))
    eval_every: int = eval_every()
    device: str = device()
    num_workers: int = num_workers()
    weights_dir: str | None = weights_dir()
    resume: bool = resume()
    overwrite: bool = overwrite()
    progress: bool = progress()


@dataclass(frozen=True)
class FedDRA:
    """`fedheads feddra`: FedDRA (federated distributionally robust vision-language alignment) and its baselines."""

    manifest: Any = setting(None, "a paired (image, text) manifest", required=True)
    store: str | None = store("store with the encoders' token states (IMAGE@CUT maps, TEXT@CUT token shards): stage "
                              "1 reads them; without it stage 1 encodes live", False)
    image_encoder: str = setting("", "trainable image backbone, e.g. resnet20-cifar10, efficientnet-lite0:160",
                                 required=True)
    text_encoder: str = setting("", "text backbone, e.g. minilm-l6-v2:32 (T = 32 tokens)", required=True)
    run: FedDRARun = setting(default_factory=FedDRARun, nested=FedDRARun, inline=True)
    out: str | None = out()

    retired: ClassVar[dict[str, tuple[str, Any]]] = {  # as Finetune.retired
        **{k: (k, None) for k in ("schedule", "stage1_rounds", "batch_size", "rho", "divergence", "radius_convention",
                                  "gamma", "mu", "tau", "lr", "encoder_lr", "weight_decay", "step_scaling",
                                  "aggregation", "dro_loss", "dro_model", "dro_batches", "prox_mu", "image_trainable",
                                  "text_trainable", "bn", "stage1_inputs")},
        "steps_per_stage": ("steps", None), "no_two_stage": ("two_stage", False), "no_augment": ("augment", False)}


# ------------------------------------------------------------------ Flower: simulate, serve, join
DROPOUT_POLICIES = ("refuse", "continue")


def _dp(name: str, default: Any) -> Any:
    """A dp_* field of the run config: the --dp-* option of `fedheads train` (its doc), 0 or "" for
    "not given" (a Flower run config holds no None)."""
    f = next(f for f in fields(Mechanism) if f.name == name)
    return setting(default, str(f.metadata["doc"]) + (" (0: not given)" if default == 0.0 and f.default is None else ""),
                   choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"))


@dataclass(frozen=True)
class FlowerRunConfig(Schedule):
    """One federated run over Flower: the options of `fedheads simulate` / `serve` (Flower run
    config keys: the field names with '-'). Flat and TOML-typed: 0 and "" mean "not given"."""

    algorithm: str = setting("fedncm", "see `fedheads algorithms`", required=True)
    backbones: str = setting("", "comma-separated; every node concatenates them in this order", required=True,
                             metavar="B,...")
    rounds: int = rounds(1)
    seed: int = setting(0, "run seed (participants, client initialisations, batches)")
    fraction: float = fraction()
    eval_every: int = eval_every()
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
    overwrite: bool = overwrite()
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
        self.check_schedule()
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


@dataclass(frozen=True)
class Simulate:
    """`fedheads simulate`: an algorithm over Flower's simulation runtime in this process (the results of `train`)."""

    store: str | None = store("feature store; one virtual node per client")
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
    store: str | None = store("this node's own feature store")
    client: str = setting("", "which client of the store / manifest this node is (default: the only one)")
    manifest: str = setting("", "this node's images: extracted into --store on first use")
    device: str = device("cpu")
    weights_dir: str = setting("", "backbone weights for the extraction")
    port: int = setting(0, "local port of the node's ClientApp API (default: a free one)")
    root_certificates: str | None = setting(None, "CA certificate of a TLS SuperLink (default: insecure)")
    log: str = setting("", "where the SuperNode's output goes (default: STORE.flower.log beside the store; '-': this "
                       "console)")
