"""The backbone registry names no backbone module: each module of embedcache.backbones declares
what it registers (DECLARES, read without importing it) and registers exactly that; a new
backbone or family is one file; families resolve names by prefix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from embedcache import backbone_names
from embedcache.backbones import registry
from embedcache.errors import UserError


def test_each_module_registers_what_it_declares():
    registry.registered_names()  # loads the built-in modules
    by_module: dict[str, set[str]] = {}
    for name, entry in registry._REGISTRY.items():  # (a test may have registered its own: their modules are tests')
        by_module.setdefault(entry.factory.__module__, set()).add(name)
    for prefix, family in registry._FAMILIES.items():
        by_module.setdefault(family.factory.__module__, set()).add(prefix)
    declared = backbone_names.declarations()
    assert declared, "no backbone module declares anything"
    for module, names in declared.items():
        want = {n.split("<", 1)[0] for n in names}
        assert by_module.get(module, set()) == want, module
    test_doubles = {n for n, e in registry._REGISTRY.items() if not e.factory.__module__.startswith("embedcache.")}
    assert set(registry.registered_names()) - test_doubles == set(backbone_names.builtin_names())


def test_the_registry_imports_no_backbone_module():
    import ast

    tree = ast.parse((backbone_names._DIR / "registry.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & set(backbone_names.builtin_modules())


@pytest.fixture
def scratch_package(tmp_path, monkeypatch):
    """A stand-in for the backbones package directory, with a fresh registry state."""
    pkg = tmp_path / "scratch_backbones"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backbone_names, "_DIR", pkg)
    monkeypatch.setattr(backbone_names, "PACKAGE", "scratch_backbones")
    backbone_names.declarations.cache_clear()
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_FAMILIES", {})
    monkeypatch.setattr(registry, "_LOADED", [])
    yield pkg
    backbone_names.declarations.cache_clear()
    for m in [m for m in sys.modules if m.startswith("scratch_backbones")]:
        del sys.modules[m]


def test_a_new_family_is_one_file(scratch_package):
    (scratch_package / "widenet.py").write_text(textwrap.dedent('''
        import torch

        from embedcache.backbones.base import TorchBackbone
        from embedcache.backbones.preprocessing import ImagePreprocessing
        from embedcache.backbones.registry import register_backbone, register_family

        DECLARES = ("widenet", "widenet:<width>")
        PRE = ImagePreprocessing(input_size=(3, 8, 8), resize=(8, 8))


        def build(weights_dir, device, width=4, name="widenet"):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
            return TorchBackbone(name, net, weights_sha256="0" * 64, preprocess=PRE, device=device)


        def family(name, weights_dir, device):
            return build(weights_dir, device, width=int(name.split(":")[1]), name=name)


        register_backbone("widenet", build, description="test", feature_dim=4)
        register_family("widenet:", family)
    '''))
    assert backbone_names.builtin_names() == ["widenet"] and backbone_names.family_prefixes() == ("widenet:",)
    backbone_names.check_backbone_name("widenet:9")  # known without importing the module
    with pytest.raises(UserError, match="widenett: unknown backbone; did you mean widenet?"):
        backbone_names.check_backbone_name("widenett")
    assert "scratch_backbones.widenet" not in sys.modules
    assert registry.create_backbone("widenet").feature_dim == 4
    assert registry.create_backbone("widenet:6").feature_dim == 6
    assert [r.name for r in registry.list_backbones()] == ["widenet"]
    with pytest.raises(UserError, match="owns it"):
        registry.register_backbone("widenet:7", lambda wd, dev: None, description="x")


def test_a_family_prefix_ends_in_a_colon():
    with pytest.raises(UserError, match="ends in ':'"):
        registry.register_family("nocolon", lambda name, wd, dev: None)


def test_modules_are_not_imported_to_check_a_name():
    code = ("import sys; from embedcache.backbone_names import check_backbone_name; "
            "check_backbone_name('efficientnet-lite2'); check_backbone_name('timm:resnet18'); "
            "print(sorted(m for m in ('torch', 'embedcache.backbones') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
