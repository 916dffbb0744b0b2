"""The algorithm protocol every fedheads algorithm implements, and the types the engines pass.

An algorithm is typed state plus pure functions (fedjax style); the engines decide how clients
run. Conventions:
- A client state and a client->server message are frozen dataclasses whose tensor leaves all
  have a leading client axis [M, ...]. The vectorised engine passes all participating clients
  at once; the loop engine passes one (M=1) and concatenates the messages; a networked driver
  would pass one. The maths never knows which.
  A message whose clients send different numbers of items (FedCOF: the means of the classes
  each client holds) keeps them as consecutive runs per client and is a `core.tree.RaggedRows`:
  it says how to take client rows and how large one client's part is; the engines and drivers
  concatenate and select it through core/tree.py as any other message.
- Server state and broadcast have no client axis. The broadcast is what every participant
  receives; the engine counts its size once per participant as downlink traffic.
- Server aggregation is written as SUMS of client contributions followed by a small finalize
  (weighted prototype = sum(count*proto)/sum(count), FedAvg = sum(w*delta)/sum(w)), so the same
  algorithm could later run under secure aggregation.
- Randomness is a pure function of (seed, round, client global index, ...) (core/rng.py,
  core/batching.py), never of the order in which clients are processed; per-client
  initialisations take their seeds from DataSpec.client_ids (core/heads.client_seeds).
- Message sizes: `core.tree.payload_size` (numel and bytes of every field sent, or the type's
  own `comm_size()`), so the engine logs communication actually sent up and down per round.
- Every optional behaviour is a typed default of :class:`AlgorithmBase` (evaluation-time
  adaptation, global rule, prototype view, secure-aggregation form, differential-privacy
  sensitivities, the linear head fine-tuning starts from, the papers' communication convention,
  per-client server rows, data-sized server fields, one-pass statistics, collection rounds, state
  fields an update replaces unread). An algorithm overrides what it has, in its own file; no other
  module switches on algorithm names.
- The per-run specification (dimensions, seeds) lives in the states, never on `self`: one
  algorithm object may run several federations, and a state alone is enough to predict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from embedcache.errors import UserError
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.tree import tree_map

CS = TypeVar("CS")  # client state (stacked)
SS = TypeVar("SS")  # server state
Msg = TypeVar("Msg")  # client -> server message (stacked)
Bc = TypeVar("Bc")  # server -> client broadcast


@dataclass(frozen=True)
class RoundCtx:
    """What a client or server function may know about the round."""

    round: int  # 0-based communication round
    seed: int  # run seed (combine with round and client_index for randomness)
    participants: torch.Tensor  # [P] int64 positions in the stacked federation of this round's participants
    # (sorted; global ids only where the engine keeps the data's order: data.client_index holds them)
    num_clients: int  # M of the whole federation
    noise_std: Mapping[str, float] | None = None  # differential privacy: the Gaussian noise std per entry of each
    # secure-sum field in the totals this server step receives (fedheads.privacy passes it to the secure form's
    # aggregate, so a finalize can adapt to it: Fed3R's ridge penalty); None: exact totals


@dataclass(frozen=True)
class Init(Generic[CS, SS, Bc]):
    """Result of Algorithm.init."""

    client_state: CS  # stacked over ALL clients of the federation
    server_state: SS
    broadcast: Bc  # what round 0's participants receive


@dataclass(frozen=True)
class SecureForm(Generic[SS, Msg, Bc]):
    """How an algorithm's message splits into sums that secure aggregation (SecAgg+) adds, and
    what still travels in the clear. The Flower driver quantises and masks the sums; the
    algorithm file says which fields they are (fedheads.flower.secure does the rest)."""

    sums: Callable[[Msg], dict[str, torch.Tensor]]  # one client's message (client axis 1) -> its contributions (no client axis)
    integer: tuple[str, ...]  # fields holding integers (rounded back after dequantisation)
    clear: Callable[[Msg], Msg | None]  # one client's message -> what still travels in the clear (None: nothing)
    aggregate: Callable[[SS, Msg | None, dict[str, torch.Tensor], RoundCtx], tuple[SS, Bc]]
    # (server_state, stacked clear messages or None, totals, ctx) -> (server_state, broadcast)


@dataclass(frozen=True)
class LocalForm(Generic[CS, Msg, Bc]):
    """How an algorithm's clients release statistics of their own data under local differential
    privacy: each client's statistics are noised on the client (fedheads.privacy, mode "local")
    and the message is built from the noisy ones (post-processing), so the server never sees
    exact statistics. For messages that are no sums (per-client mixtures: FedPFT)."""

    stats: Callable[[CS, Bc, FedData, RoundCtx], tuple[CS, dict[str, torch.Tensor], torch.Tensor]]
    # (client_state, broadcast, data, ctx) -> (client_state, {field: [M, ...] float64}, releases [M] bool)
    message: Callable[[dict[str, torch.Tensor], torch.Tensor, FedData, RoundCtx], Msg]
    # (noisy statistics {field: [M, ...]}, releases [M] bool, data, ctx) -> the message


@dataclass(frozen=True)
class HeadArch:
    """The head on top of frozen backbones as the papers count it (FedPCL Sec. 5.1)."""

    backbone_dims: tuple[int, ...] = (512,)  # output size of each frozen backbone (concatenated)
    proj_dim: int = 256  # projection network output (FC 512K -> 256)
    num_classes: int = 10  # classifier output (baselines) / number of prototypes

    @property
    def in_dim(self) -> int:
        return int(sum(self.backbone_dims))


@dataclass(frozen=True)
class PaperRoundComm:
    """What ONE participating client sends and receives in one round, in parameters, by the
    papers' conventions (weights only, as FedPCL Table 2 counts them)."""

    upload: int  # FedPCL Table 2 "# of Comm Params"
    download: int  # what the server sends that client
    silent_rounds: int = 0  # leading rounds in which nothing is downloaded


class AlgorithmBase(Generic[CS, SS, Msg, Bc]):
    """Base class of every registered algorithm: the five protocol functions plus a typed
    default for each optional hook. Subclasses set `name`, `description` and `config`
    (their frozen config dataclass) and take one config instance in `__init__`."""

    name: str = ""  # registry name (used in logs and result files)
    description: ClassVar[str] = ""  # one line for `fedheads algorithms`
    config: ClassVar[type | None] = None  # the config dataclass `__init__` takes
    global_rule: ClassVar[str | None] = None
    """Key of `predict` whose scores depend on the server state alone (the run's global model):
    `fedheads predict --images` classifies samples of no client with it. None: personalised
    heads or local prototypes only (prediction needs `--client`)."""
    server_client_fields: ClassVar[tuple[str, ...] | None] = ()
    """Server-state fields that, against the convention above, hold one row per client of the
    federation (FedPCL's prototype bank): the vectorised engine stacks clients in the order it
    computes fastest in (core/order.py) and puts these rows back with the client state. None:
    the server state depends on client positions in a way no row permutation restores (FedCOF's
    bank of the (client, class) pairs received, sorted by client position): the engine keeps the
    data's order.
    Per-client randomness is keyed by global ids (data.client_index, DataSpec.ids())."""
    server_sized_fields: ClassVar[tuple[str, ...]] = ()
    """Server-state tensor fields whose size depends on the training data, not only on D, C and M
    (FedCOF's bank of client class means, sized by the (client, class) pairs received): a saved state
    restores them at their saved size, since prediction rebuilds its template without the data."""
    one_pass: ClassVar[bool] = False
    """Every client sends its statistics once and later rounds only add zeros (FedNCM Alg. 1,
    Fed3R, FedCOF): with every client in every round, `train` and `compare` run one round."""
    seed_free: bool = False
    """The run does not depend on its seed when every client takes part in every round and no DP
    noise is drawn (FedNCM, Fed3R, FedCOF: deterministic functions of the data): `train` then runs
    one seed for all it is asked for and says so. An instance may set it from its settings."""
    sums_messages: ClassVar[bool] = False
    """The server step reads the participants' messages only through their sum over the client
    axis (FedNCM Alg. 1 line 5, Fed3R's summed Grams): when holding every participant's message
    would pass the engine's memory budget, the vectorised engine adds them group by group
    (`summed_update`) and hands `server_aggregate` one row holding the sum."""
    clamp_noisy_counts: ClassVar[bool] = True
    """Under DP the private wrapper clamps each round's noisy totals of the secure form's integer
    fields (counts) to >= 1, so FedNCM divides by a positive count (fedheads.privacy.Private). False:
    the algorithm takes the raw noisy counts and decides presence itself (CCVR and Fed3R, on their
    running total)."""
    collect_rounds: int = 0
    """Leading rounds that only collect statistics (FedPCL's round 0, LP's FedNCM round): R
    rounds train R - collect_rounds."""
    update_replaces: ClassVar[tuple[str, ...]] = ()
    """Client-state fields that `client_update` replaces without reading them (FedAvg's model
    per client: local training starts from the broadcast). The vectorised engine hands the call
    one participant's row of these seen by all (their shape, nothing copied) instead of a copy
    of every participant's rows; the loop engine hands the real rows, so the engines'
    equivalence tests catch a field that is read after all."""

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg

    # ------------------------------------------------------------------ the protocol
    def init(self, spec: DataSpec, seed: int) -> Init[CS, SS, Bc]:
        """States for the whole federation (client axis = spec.num_clients) and the first broadcast."""
        raise NotImplementedError

    def client_update(self, client_state: CS, broadcast: Bc, data: FedData, ctx: RoundCtx) -> tuple[CS, Msg]:
        """Local work of the clients in `data` (client axis of client_state matches data)."""
        raise NotImplementedError

    def server_aggregate(self, server_state: SS, messages: Msg, ctx: RoundCtx) -> tuple[SS, Bc]:
        """Combine the participants' stacked messages (rows ordered as ctx.participants). The
        vectorised engine may stack them in buffers it reuses next round: a state that keeps a
        view of a message keeps its memory (the engine then stops reusing it), anything else is
        read here and not after."""
        raise NotImplementedError

    def predict(self, client_state: CS, server_state: SS, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scores [M, N, C] for x [M, N, D]; "main" is the algorithm's own rule."""
        raise NotImplementedError

    def trainable_params(self, client_state: CS) -> int:
        """Trainable values held per client (counted from the actual tensors)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional hooks
    def summed_update(self, client_state: CS, broadcast: Bc, data: FedData, ctx: RoundCtx) -> tuple[CS, Msg]:
        """`client_update` of the clients in `data` with their messages added over the client axis
        (one row), for algorithms that declare `sums_messages`. The default sums what
        `client_update` returns; override it where the sum costs less than the messages (a
        Gram of the stacked rows instead of one per client): the engine then calls it on whole
        groups of clients, since no per-client message is held."""
        cs, msg = self.client_update(client_state, broadcast, data, ctx)
        return cs, tree_map(lambda t: t.sum(0, keepdim=True), msg)

    def adapt_for_eval(self, client_state: CS, server_state: SS, data: FedData) -> CS | None:
        """The client state that is evaluated, when the reported model is a client-side
        adaptation of the CURRENT server model (Per-FedAvg's one-step personalisation); None
        (the default) evaluates the state as trained. Both engines call it before every
        evaluation, never feed its result back into training, and return the last adapted state
        as the run's final client state. Must be a pure function of its arguments."""
        return None

    def prototype_view(self, client_state: CS, server_state: SS, x: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str] | None:
        """For faiss batch prediction: (queries [M,N,d], prototypes [M,C,d], present [M,C],
        metric "ip" | "cosine" | "sqeuclidean") whose nearest prototype is `predict`'s "main"
        argmax; None (the default): prediction uses `predict` itself."""
        return None

    def secure_form(self, message: Msg | None = None) -> SecureForm[SS, Msg, Bc]:
        """How this algorithm's messages aggregate under SecAgg+ (of `message` when given; a
        message type may change between rounds). The default refuses in one line."""
        raise UserError(f"secagg: {self.name} has no secure form (its server step is not a sum of client contributions)")

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """L2 sensitivity of each secure-sum field (the keys of `secure_form().sums`) when one
        training example, its feature clipped to L2 norm `clip`, is added or removed. Used by
        the Gaussian mechanism of differential privacy; the default refuses in one line."""
        raise UserError(f"dp: {self.name} has no differentially private form (its messages are not clipped sums)")

    def local_form(self) -> LocalForm[CS, Msg, Bc]:
        """The per-client statistics that local differential privacy noises on each client, and
        the message built from them (keys as `dp_sensitivity`'s). The default refuses in one line."""
        raise UserError(f"dp: {self.name} has no local form (--dp-mode local noises per-client statistics, "
                        "which it does not send); use --dp-mode central or distributed")

    def dp_finalize(self, noise_std: dict[str, float], spec: DataSpec) -> dict[str, Any]:
        """What the server's finalize makes of secure-sum totals that carry Gaussian noise of std
        noise_std[f] per entry (differential privacy; a function of the noisy totals is
        post-processing, of no privacy cost: e.g. Fed3R's ridge penalty from the Gram's noise), for
        results.json's privacy block. The finalize reads the noise from `RoundCtx.noise_std`; this
        hook only reports, and leaves the algorithm object as it is (one instance may run with DP,
        then without). Called by the private wrapper before each `init`; the default returns {}."""
        return {}

    def linear_head(self, server_state: SS) -> dict[str, torch.Tensor] | None:
        """The linear classifier {"cls.weight": [D, C], "cls.bias": [C]} (the core's layout, no
        client axis, float32) that this server state defines, for fine-tuning or linear probing
        to start from (`fedheads finetune --head NAME`: round 0 is this head); None (the
        default): the algorithm's model is not a linear head on the features."""
        return None

    def saved_runs(self) -> dict[str, tuple[str, int | None]]:
        """Run directories this algorithm's settings name and reads, {setting: (path, seed or None
        for the run's first)}: CCVR's head=RUN_DIR. Before training, the drivers check that each
        was trained on features of this run's classes and backbones, open it and hand it to
        `use_saved` (fedheads.run.saved.attach_saved_runs). Default: none."""
        return {}

    def use_saved(self, key: str, run: Any) -> None:
        """Receive the saved run `saved_runs()[key]` names, opened by the driver (a
        fedheads.run.saved.Trained: its algorithm, one seed's states, classes, feature size)."""
        raise NotImplementedError(f"{self.name}: names no saved run {key!r}")

    def trained_notes(self, server_state: SS, classes: list[str]) -> list[str]:
        """What a user must know about a trained server state that its accuracy does not say (classes
        a head never saw), one line each, printed as `note:` lines and kept in results.json's
        `notes`; `classes`: the class names by label. Raises UserError (one line) when the state
        learned nothing, so no run is reported as trained from its initialisation. Default: []."""
        return []

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm | None:
        """Per-client, per-round upload and download by its papers' convention (for the
        papers' communication columns); None: no published convention."""
        return None


Algorithm = AlgorithmBase  # the name the engines' signatures use
