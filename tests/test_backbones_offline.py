"""timm / torchvision weights on a machine without network: one clear error as
soon as the hub is known to be out of reach (no minute of client retries), and a model already
in the Hugging Face cache still loads with no network at all."""

from __future__ import annotations

import socket
import threading

import pytest
import timm
from backbone_doubles import TIMM_MODEL, write_timm_checkpoint

from embedcache.backbones import create_backbone
from embedcache.backbones import weights as W
from embedcache.errors import UserError


def _closed_port() -> int:
    """A 127.0.0.1 port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty HF cache, a hub endpoint that refuses connections, and timm's downloader
    replaced by a tripwire: reaching it would mean minutes of retries on a real offline box."""
    from huggingface_hub import constants

    for var in ("EMBEDCACHE_OFFLINE", "HF_HUB_OFFLINE", "EMBEDCACHE_WEIGHTS", "EMBEDCACHE_ASSETS",
                "https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "ec"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(W, "_PROBED", {})
    real = timm.create_model

    def tripwire(*args, pretrained=False, **kw):
        if pretrained:
            raise AssertionError("timm tried to download")
        return real(*args, pretrained=False, **kw)

    monkeypatch.setattr(timm, "create_model", tripwire)
    return tmp_path


def test_unreachable_hub_is_one_line_naming_model_and_remedy(no_hub):
    with pytest.raises(UserError) as err:
        create_backbone(f"timm:{TIMM_MODEL}", weights_dir=no_hub / "w")
    msg = str(err.value)
    assert msg.startswith(f"timm:{TIMM_MODEL}: weights not found and not downloadable (offline? 127.0.0.1:")
    assert "\n" not in msg and f"{no_hub / 'w' / 'timm' / TIMM_MODEL}.safetensors" in msg
    assert "hf download timm/test_resnet.r160_in1k" in msg


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "EMBEDCACHE_OFFLINE"])
def test_offline_settings_skip_the_probe(no_hub, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(W, "unreachable", lambda *a, **k: pytest.fail("probed although offline was set"))
    with pytest.raises(UserError, match=rf"not downloadable \(\${var}=1\)"):
        create_backbone(f"timm:{TIMM_MODEL}", weights_dir=no_hub / "w")


def test_cached_model_loads_without_network(no_hub):
    snap = no_hub / "hf" / "models--timm--test_resnet.r160_in1k" / "snapshots" / ("0" * 40)
    state = write_timm_checkpoint(snap / "model.safetensors", seed=3)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    bb = create_backbone(f"timm:{TIMM_MODEL}", weights_dir=no_hub / "w")
    key = next(k for k in state if k.endswith("conv1.0.weight"))
    assert bb.module.state_dict()[key].equal(state[key])
    assert bb.weights_sha256 == W.sha256_file(snap / "model.safetensors")


def test_probe_is_bounded_even_when_connecting_hangs(monkeypatch):
    release = threading.Event()

    def hang(*args, **kw):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setattr(W, "_PROBED", {})
    try:
        why = W.unreachable("https://hub.invalid/x", timeout=0.2)
    finally:
        release.set()
    assert why == "hub.invalid:443: no answer within 0.2 s"


def test_probe_goes_through_the_proxy(monkeypatch):
    seen = []

    def connect(addr, timeout):
        seen.append(addr)
        raise OSError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(W, "_PROBED", {})
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert W.unreachable("https://huggingface.co") == "proxy.example:3128: Connection refused"
    assert seen == [("proxy.example", 3128)]


def test_torchvision_unreachable(monkeypatch, tmp_path):
    import torch

    monkeypatch.delenv("EMBEDCACHE_OFFLINE", raising=False)
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "ec"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(W, "unreachable", lambda url, timeout=W.PROBE_SECONDS: "download.pytorch.org:443: refused")
    with pytest.raises(UserError, match=r"^tv:mobilenet_v3_small: weights not found and not downloadable "
                                        r"\(offline\? download.pytorch.org:443: refused\)"):
        create_backbone("tv:mobilenet_v3_small", weights_dir=tmp_path / "w")
