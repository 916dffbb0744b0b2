"""Stage 1 (HeadTune) of FedNCM+FT / Fed3R+FT / FedCOF+FT / LP+FT, computed on the feature
store, and the check that the store really holds the live model's features.

Legate et al., "Guiding The Last Layer in Federated Learning with Pre-Trained Models", NeurIPS
2023: Sec. 3.2 (FedNCM: exact class means l_c of the frozen features; head weight l_c/||l_c||,
bias 0), Sec. 3.3 (HeadTune then FineTune), App. C.2 / Table 6 (K rounds of LP as stage 1).
Both run through fedheads' own algorithms (`fedncm`, `lp`) and engine on the cached features,
so stage 1 costs no live pass at all. Any one-pass head whose state defines a linear classifier
(AlgorithmBase.linear_head: Fed3R's ridge classifier, FedCOF's) starts fine-tuning the same way.

The store check (never a silent re-computation): every shard the fine-tuning reads must have
been extracted with the live backbone's weights (sha256) and evaluation preprocessing, and hold
exactly the manifest's samples of its client and split (sample_list_hash).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.fedncm import head_bias
from fedheads.core.engine import run
from fedheads.report import communication as comm
from fedheads.run.checks import FINETUNE_HEADS
from fedheads.run.load import load_fed_data

HEADS = FINETUNE_HEADS  # the names are listed in fedheads.run.checks, read before torch loads


@dataclass(frozen=True)
class HeadResult:
    """The stage-1 head in nn.Linear layout and what computing it cost."""

    method: str  # a one-pass head ("fedncm", "fed3r", "fedcof") | "lp" | "random"
    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor  # [C]
    rounds: int  # communication rounds of stage 1 (0 for random)
    per_client: dict[str, float] | None = None  # stage-1 accuracy (%) on the store's test split
    communication: dict[str, Any] = field(default_factory=dict)  # measured ledger of stage 1
    train_samples_seen: int = 0  # samples whose features stage 1 used per pass (compute, App. A)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def check_store(store: str, manifest: Any, backbone: Any, name: str, *, cut: str | None = None,
                map_shape: Sequence[int] | None = None) -> None:
    """UserError unless every client/split shard of `name` in `store` was extracted from the
    manifest's samples with `backbone`'s weights and evaluation preprocessing (plus, for a cut
    backbone `B@CUT`, that cut and map shape)."""
    from embedcache.store.reader import open_store, shard_attributes

    info = open_store(store)
    want_pre = {k: v for k, v in _jsonable(dict(backbone.preprocess)).items() if k not in ("cut", "map_shape")}
    for client in manifest.clients:
        for split in ("train", "test"):
            sh = info.shard(name, client.name, split)
            where = f"{store}: {name}/{client.name}/{split}"
            if sh is None:
                raise UserError(f"{where}: no such shard; run `embedcache extract --manifest ... --backbones {name}`")
            if not sh.complete:
                raise UserError(f"{where}: shard incomplete; run embedcache extract again")
            a = shard_attributes(info, sh)
            if a.get("weights_sha256") != backbone.weights_sha256:
                raise UserError(f"{where}: extracted with other weights (sha256 {str(a.get('weights_sha256'))[:12]}"
                                f" vs the live backbone's {backbone.weights_sha256[:12]}); re-extract")
            pre = dict(a.get("preprocess") or {})
            got_cut, got_shape = pre.pop("cut", None), pre.pop("map_shape", None)
            if pre != want_pre:
                diff = sorted(k for k in set(pre) | set(want_pre) if pre.get(k) != want_pre.get(k))
                raise UserError(f"{where}: extracted with other preprocessing (differs in {', '.join(diff)}); re-extract")
            if got_cut != cut or (map_shape is not None and list(got_shape or []) != list(map_shape)):
                raise UserError(f"{where}: holds cut {got_cut!r} map {got_shape}, expected cut {cut!r} map "
                                f"{list(map_shape) if map_shape is not None else None}")
            if a.get("sample_list_hash") != manifest.sample_list_hash(client.name, split):
                raise UserError(f"{where}: holds other samples than the manifest's {client.name}/{split} "
                                "(another manifest?); extract with this manifest")


def head_from_store(method: str, store: str, backbone_name: str, clients: Sequence[str], *,
                    num_classes: int, feature_dim: int, seed: int, head_rounds: int = 5,
                    ncm_bias: str = "zero", lp_settings: dict[str, Any] | None = None,
                    device: str = "cpu") -> HeadResult:
    """The starting head for fine-tuning (see the module docstring)."""
    from fedheads.run.checks import finetune_heads

    if method not in finetune_heads([method]):
        raise UserError(f"--head {method!r}: use one of {', '.join(finetune_heads([method]))}")
    if method == "random":
        from torch import nn

        from fedheads.finetuning.model import random_head_init

        lin = nn.Linear(feature_dim, num_classes)
        random_head_init(lin, seed)
        return HeadResult("random", lin.weight.detach().clone(), lin.bias.detach().clone(), 0)
    data = load_fed_data(store, [backbone_name], device, clients=list(clients))
    if method != "lp":  # a one-pass head: the linear classifier its state defines (AlgorithmBase.linear_head)
        # --ncm-bias is FedNCM's own `bias` setting (FedNCM+FT, Sec. 3.2: b = 0; or the authors' random bias)
        settings = {"bias": head_bias(ncm_bias)} if method == "fedncm" and head_bias(ncm_bias) != "paper" else {}
        alg = create_algorithm(method, **settings)
        res = run(alg, data, 1, seed=seed, progress=False)
        linear = alg.linear_head(res.server_state)
        if linear is None:
            raise UserError(f"--head {method}: {method} does not define a linear head to fine-tune from")
        head = linear
        rounds = 1
    else:
        if head_rounds < 1:
            raise UserError(f"head_rounds {head_rounds}: LP needs at least one round")
        alg = create_algorithm("lp", **(lp_settings or {}))
        res = run(alg, data, head_rounds, seed=seed, progress=False)
        head = {k: v for k, v in res.server_state.params.items() if k.startswith("cls.")}
        rounds = head_rounds
    acc = res.final_accuracy("main")
    per_client = {n: 100.0 * float(a) for n, a in zip(data.client_names, acc.tolist()) if a == a}
    return HeadResult(method, head["cls.weight"].T.contiguous().cpu(), head["cls.bias"].contiguous().cpu(), rounds,
                      per_client, comm.ledger_from_rounds(res.history).summary(), int(sum(data.n_train)))
