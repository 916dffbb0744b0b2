"""A `fedheads finetune` run directory read back for `fedheads predict`: the seed's exported
backbone (`state/seed<S>.backbone.pt`, a `ckpt:` file: the trained stages, or the adapters merged
into their layers, W0 + s B A) followed by the final linear head from the seed's last checkpoint.

The head is served as fedheads' `lp` global model (the same nn.Linear rule), so prediction runs
through the head path unchanged: new images are extracted with the `ckpt:` backbone and classified
by the head. Merged adapters predict as the adapted network (tests/test_lora.py). A personalised run
(FedSA-LoRA: each client's own B and head) has one model per client and no single backbone: refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedcache.errors import UserError


def is_finetune_run(results: dict[str, Any]) -> bool:
    return "stages" in results and "figure1" in results  # contract 7's results.json (fedheads.run.saved refuses it)


def trained_from_finetune(run_dir: Path, config: dict[str, Any], results: dict[str, Any], seed: int | None,
                          device: str) -> Any:
    """fedheads.run.saved.Trained of a fine-tuning run's seed (module docstring)."""
    from dataclasses import replace

    from embedcache.backbones import create_backbone
    from fedheads.algorithms import create_algorithm
    from fedheads.core.federation import DataSpec
    from fedheads.finetuning.driver import CKPT_FORMAT
    from fedheads.run.checkpoint import load_checkpoint
    from fedheads.run.load import resolve_device
    from fedheads.run.saved import Trained

    seeds = list(results["seeds"])
    seed = int(seeds[0]) if seed is None else seed
    if seed not in seeds:
        raise UserError(f"--seed {seed}: the run has seeds {seeds}")
    ad = results.get("adapters") or {}
    if ad.get("local_head") or (set(ad.get("trains", [])) - set(ad.get("shared", [])) and ad.get("algorithm") != "flora"):
        raise UserError(f"{run_dir}: a {ad.get('algorithm')} run keeps a model per client (its own adapters and head); "
                        "fedheads predict serves runs with one global model")
    run_cfg = {**config["run"], "seed": seed}
    blob = load_checkpoint(run_dir / "state" / f"seed{seed}.ckpt.pt", CKPT_FORMAT, run_cfg)
    if blob["round"] != results["training_rounds"]:
        raise UserError(f"{run_dir}: the checkpoint holds round {blob['round']} of {results['training_rounds']}")
    weight, bias = blob["params"]["head/weight"], blob["params"]["head/bias"]  # [C, D], [C]
    exported = run_dir / "state" / f"seed{seed}.backbone.pt"
    backbone = f"ckpt:{exported}" if exported.is_file() else str(config["backbone"])  # trainable=head: unchanged
    dev = resolve_device(device)
    C, D = (int(v) for v in weight.shape)
    clients = list(results["clients"])
    alg = create_algorithm("lp")
    spec = DataSpec(D, C, len(clients), (1,) * len(clients), dev)
    init = alg.init(spec, seed)
    ss = replace(init.server_state, params={"cls.weight": weight.T.contiguous().to(dev), "cls.bias": bias.to(dev)})

    bb = create_backbone(backbone, device="cpu")
    classes = list(results.get("classes") or [str(i) for i in range(C)])
    fingerprint = {"classes": classes, "backbones": {backbone: {"dim": int(bb.feature_dim), "weights_sha256":
                                                                bb.weights_sha256, "preprocess": dict(bb.preprocess)}}}
    return Trained(alg, init.client_state, ss, clients, classes, [backbone], fingerprint, False, dev, D)

