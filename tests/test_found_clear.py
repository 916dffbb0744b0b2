"""Refusals that were correct but unreadable: each is one line naming the file and why."""

from __future__ import annotations

import collections

import pytest
import torch

from embedcache.backbones import weights as W
from embedcache.errors import UserError


class _Pickled:
    """A class a weights-only load refuses to rebuild (as a timm checkpoint pickled whole)."""


def test_a_pickled_checkpoint_is_refused_in_one_line_naming_the_file_and_the_class(tmp_path):
    path = tmp_path / "timm" / "resnet18.pth"
    path.parent.mkdir()
    torch.save({"state_dict": collections.OrderedDict(a=torch.zeros(2)), "obj": _Pickled()}, path)
    with pytest.raises(UserError) as e:
        W.load_torch(path, who="timm:resnet18")
    text = str(e.value)
    assert "\n" not in text and "\x1b" not in text and str(path) in text
    assert "_Pickled" in text and "weights-only" in text and "state_dict" in text


def test_an_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "broken.pth"
    path.write_bytes(b"not a checkpoint\n" * 50)
    with pytest.raises(UserError) as e:
        W.load_torch(path, who="tv:resnet18")
    assert "\n" not in str(e.value) and str(path) in str(e.value)
