"""Open families: ``timm:<model>`` (any timm model) and ``tv:<model>`` (torchvision).

Weights, first found wins:
  1. a local file ``<weights_dir>/timm/<model>.(safetensors|pth)`` or
     ``<weights_dir>/tv/<model>.(safetensors|pth)`` (a full checkpoint, classifier included or
     not; a ``state_dict``/``model`` wrapper and a ``module.`` prefix are accepted);
  2. the Hugging Face hub cache (timm) or the torch hub cache (both), without network;
  3. online only: timm ``pretrained=True`` / the torchvision weights enum ``DEFAULT``, which
     download into those caches. "Online" is decided before the download starts
     (``weights.download_blocked``: ``$EMBEDCACHE_OFFLINE``, ``$HF_HUB_OFFLINE``, and a TCP
     connection to the hub within a few seconds), so an offline machine is told at once rather
     than after a minute of hub retries.
Otherwise one UserError says where it looked and how to provide the weights. Keys are matched strictly (classifier keys aside).

Features: timm ``create_model(num_classes=0)`` gives the pooled pre-logits feature; torchvision
models get their last ``nn.Linear`` replaced by Identity (resnet ``fc`` -> 512/2048-d,
mobilenet_v3 -> the 1280-d hidden layer, vgg -> 4096-d). Preprocessing comes from the model:
timm ``resolve_model_data_config`` + ``create_transform``; torchvision ``weights.transforms()``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from embedcache.backbones import weights as W
from embedcache.backbones.base import TorchBackbone, load_strict, state_dict_sha256, strip_prefix
from embedcache.backbones.preprocessing import MILD_CROP, ImagePreprocessing, TimmPreprocessing
from embedcache.backbones.registry import BackboneInfo, register_family
from embedcache.errors import UserError
from embedcache.pixels import to_rgb8

DECLARES = ("timm:<model>", "tv:<model>")
_EXTS = (".safetensors", ".pth")
# The random view used for train=True (multi-view extraction), milder than ImageNet training.
TIMM_TRAIN_AUG = {"scale": [0.6, 1.0], "ratio": [0.75, 1.3333333333333333], "hflip": 0.5, "color_jitter": None}


def _local(family: str, model: str, weights_dir: Path | None) -> Path | None:
    for ext in _EXTS:
        p = W.find_file(f"{family}/{model}{ext}", weights_dir)
        if p is not None:
            return p
    return None


def _read_state(path: Path, *, who: str) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(path), device="cpu")
        except Exception as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc})") from None
    else:
        state = W.load_torch(path, who=who)
        for wrap in ("state_dict", "model"):
            if isinstance(state, dict) and isinstance(state.get(wrap), dict):
                state = state[wrap]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a state dict of tensors")
    return strip_prefix(state, "module.")


def _hub_cache_file(url: str) -> Path | None:
    if not url:
        return None
    p = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    return p if p.is_file() else None


# ---------------------------------------------------------------- timm
def _timm_cached(cfg: dict) -> Path | None:
    hub_id = cfg.get("hf_hub_id")
    if hub_id:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            pass
        else:
            names = [cfg["hf_hub_filename"]] if cfg.get("hf_hub_filename") else []
            for fname in names + ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"]:
                hit = try_to_load_from_cache(hub_id, fname)
                if isinstance(hit, str):
                    return Path(hit)
    return _hub_cache_file(cfg.get("url", ""))


def create_timm(model: str, weights_dir: Path | None, device: str) -> TorchBackbone:
    import timm
    from timm.data import create_transform, resolve_model_data_config

    name = f"timm:{model}"
    try:
        net = timm.create_model(model, pretrained=False, num_classes=0)
    except RuntimeError as exc:  # timm raises RuntimeError("Unknown model ...")
        raise UserError(f"{name}: {exc}") from None
    cfg = dict(net.pretrained_cfg)
    classifier = cfg.get("classifier") or ()
    ignore = tuple(f"{c}." for c in ((classifier,) if isinstance(classifier, str) else classifier))
    path = _local("timm", model, weights_dir) or _timm_cached(cfg)
    if path is not None:
        # A .bin from the HF cache is a torch pickle like .pth.
        load_strict(net, _read_state(path, who=name), who=f"{name} ({path})", ignore=ignore)
        digest = W.sha256_file(path)
    else:
        blocked = _timm_download_blocked(cfg)
        if blocked:
            raise UserError(f"{name}: weights not found and not downloadable ({blocked}); looked in "
                            f"{_timm_looked(model, weights_dir)}; {_timm_how(model, cfg, weights_dir)}")
        try:
            net = timm.create_model(model, pretrained=True, num_classes=0)
        except Exception as exc:
            raise UserError(f"{name}: no local weights ({_timm_looked(model, weights_dir)}) and the "
                            f"download failed ({type(exc).__name__}: {exc}); offline?") from None
        digest = state_dict_sha256(net.state_dict())
    data_cfg = resolve_model_data_config(net)
    preprocess = TimmPreprocessing(timm_version=timm.__version__, data_config=tuple(data_cfg.items()),
                                   train_augment=tuple(TIMM_TRAIN_AUG.items()))
    tf = {
        False: create_transform(**data_cfg, is_training=False),
        True: create_transform(**data_cfg, is_training=True, scale=tuple(TIMM_TRAIN_AUG["scale"]),
                               ratio=tuple(TIMM_TRAIN_AUG["ratio"]), hflip=TIMM_TRAIN_AUG["hflip"],
                               color_jitter=TIMM_TRAIN_AUG["color_jitter"]),
    }

    def transform(img, train: bool) -> torch.Tensor:
        return tf[train](to_rgb8(img))  # 16-bit pixels scaled, not clipped

    return TorchBackbone(name, net, weights_sha256=digest, preprocess=preprocess, device=device, transform_fn=transform)


def _timm_looked(model: str, weights_dir: Path | None) -> str:
    return ", ".join(W.looked_in(f"timm/{model}{e}", weights_dir) for e in _EXTS) + ", the HF/torch hub caches"


def _timm_download_blocked(cfg: dict) -> str | None:
    """Why timm's pretrained=True cannot download now, decided in seconds (None: try it)."""
    if cfg.get("hf_hub_id"):
        from huggingface_hub import constants

        if getattr(constants, "HF_HUB_OFFLINE", False):  # read by huggingface_hub at import
            return "$HF_HUB_OFFLINE=1"
        return W.download_blocked(constants.ENDPOINT, hf_hub=True)
    if cfg.get("url"):
        return W.download_blocked(cfg["url"])
    return "timm publishes no pretrained weights for it"


def _timm_how(model: str, cfg: dict, weights_dir: Path | None) -> str:
    local = W.resolve_weights_dir(weights_dir) / "timm" / f"{model}.safetensors"
    hub = cfg.get("hf_hub_id")
    fetch = (f"or run `hf download {hub}` on a connected machine and copy its Hugging Face cache "
             f"($HF_HOME, ~/.cache/huggingface) here" if hub else "or download it on a connected machine")
    return f"put a checkpoint at {local} (or pass --weights-dir) {fetch}"


# ---------------------------------------------------------------- torchvision
def _replace_last_linear(net: nn.Module) -> None:
    last = None
    for qual, mod in net.named_modules():
        if isinstance(mod, nn.Linear):
            last = qual
    if last is None:
        return
    parent_name, _, attr = last.rpartition(".")
    parent = net.get_submodule(parent_name) if parent_name else net
    setattr(parent, attr, nn.Identity())


def create_tv(model: str, weights_dir: Path | None, device: str) -> TorchBackbone:
    import torchvision
    from torchvision import models as tvm

    name = f"tv:{model}"
    if model not in tvm.list_models(module=tvm):
        raise UserError(f"{name}: not a torchvision classification model (see torchvision.models.list_models())")
    try:
        wenum = tvm.get_model_weights(model).DEFAULT
    except (ValueError, KeyError, AttributeError):
        wenum = None
    net = tvm.get_model(model, weights=None)
    path = _local("tv", model, weights_dir) or (_hub_cache_file(wenum.url) if wenum is not None else None)
    blocked = None if path is not None or wenum is None else W.download_blocked(wenum.url)
    if path is not None:
        load_strict(net, _read_state(path, who=name), who=f"{name} ({path})")
        digest = W.sha256_file(path)
    elif wenum is not None and blocked is None:
        try:
            net.load_state_dict(wenum.get_state_dict(progress=True, check_hash=True), strict=True)
        except Exception as exc:
            raise UserError(f"{name}: no local weights and the download of {wenum.url} failed "
                            f"({type(exc).__name__}: {exc}); offline?") from None
        digest = state_dict_sha256(net.state_dict())
    else:
        looked = ", ".join(W.looked_in(f"tv/{model}{e}", weights_dir) for e in _EXTS)
        why = f" and not downloadable ({blocked})" if blocked else " (torchvision publishes none)"
        raise UserError(f"{name}: weights not found{why}; looked in {looked} and the torch hub cache "
                        f"({Path(torch.hub.get_dir()) / 'checkpoints'})")
    _replace_last_linear(net)
    if wenum is not None:
        t = wenum.transforms()
        crop, resize = int(t.crop_size[0]), int(t.resize_size[0])
        mean, std, interp = list(t.mean), list(t.std), t.interpolation.value
    else:  # the usual ImageNet evaluation recipe
        crop, resize, mean, std, interp = 224, 256, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], "bilinear"
    preprocess = ImagePreprocessing(input_size=(3, crop, crop), resize=resize, crop=(crop, crop), interpolation=interp,
                                    mean=tuple(mean), std=tuple(std), train_augment=MILD_CROP,
                                    ).with_extra(torchvision_version=torchvision.__version__)
    return TorchBackbone(name, net, weights_sha256=digest, preprocess=preprocess, device=device)


# ---------------------------------------------------------------- registration
def _local_rows(family: str, source: str, weights_dir: Path | None) -> list[BackboneInfo]:
    """One row per local checkpoint found under <weights_dir>/<family>/."""
    rows: list[BackboneInfo] = []
    seen: set[str] = set()
    for d in W.search_dirs(weights_dir):
        sub = d / family
        if not sub.is_dir():
            continue
        for f in sorted(sub.iterdir()):
            if f.suffix in _EXTS and f.is_file() and f"{family}:{f.stem}" not in seen:
                seen.add(f"{family}:{f.stem}")
                rows.append(BackboneInfo(f"{family}:{f.stem}", f"{source} model {f.stem} (local checkpoint)",
                                         True, str(f), source, None))
    return rows


def _timm_rows(weights_dir: Path | None) -> list[BackboneInfo]:
    return [BackboneInfo("timm:<model>", "any timm model, pooled pre-logits feature (create_model(num_classes=0))",
                         True, "weights: <weights_dir>/timm/<model>.(safetensors|pth), HF/torch cache, or download",
                         "timm", None), *_local_rows("timm", "timm", weights_dir)]


def _tv_rows(weights_dir: Path | None) -> list[BackboneInfo]:
    return [BackboneInfo("tv:<model>", "any torchvision classification model, last Linear removed",
                         True, "weights: <weights_dir>/tv/<model>.(safetensors|pth), torch hub cache, or download",
                         "torchvision", None), *_local_rows("tv", "torchvision", weights_dir)]


def _timm_family(name: str, weights_dir: Path | None, device: str) -> TorchBackbone:
    return create_timm(name[len("timm:"):], weights_dir, device)


def _tv_family(name: str, weights_dir: Path | None, device: str) -> TorchBackbone:
    return create_tv(name[len("tv:"):], weights_dir, device)


register_family("timm:", _timm_family, rows=_timm_rows)
register_family("tv:", _tv_family, rows=_tv_rows)
