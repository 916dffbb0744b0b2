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


def test_progress_in_a_log_is_plain_lines_not_carriage_returns(monkeypatch):
    import io

    from embedcache import progress

    out = io.StringIO()
    clock = iter(float(t) for t in range(0, 10_000, 3))  # 3 s per call of the clock
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.bar(total=100, desc="extract", unit="img", file=out) as b:
        for _ in range(100):
            b.update(1)
        b.set_postfix(acc="0.9")
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and lines[0].startswith("extract: 0/100 img") and lines[-1].startswith("extract: 100/100 img")
    assert 3 < len(lines) < 60 and lines[-1].endswith("acc=0.9")  # one line per 10 s, not one per update
    assert list(progress.bar(range(3), file=io.StringIO())) == [0, 1, 2]


def test_progress_on_a_terminal_is_tqdm():
    import io

    from tqdm.auto import tqdm

    from embedcache import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    with progress.bar(total=3, file=Tty()) as b:
        assert isinstance(b, tqdm)


def test_a_missing_store_is_refused_before_torch_loads(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom fedheads.cli import main\n"
            "try:\n    main(['train', '--store', sys.argv[1], '--backbones', 'x',\n"
            "          '--algorithm', 'fed3r', '--out', sys.argv[2]])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nowhere"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "exit 2 False", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "no feature store here" in r.stderr


def test_the_main_job_says_why_fine_tuning_ends_below_its_head():
    from pipelines.quickstart import ft_story

    def res(ncm, start, ft):
        return {"algorithms": {"fedncm+ft": {"accuracy": {"mean": ncm}, "figure1": [{"accuracy": start}]},
                               "random+ft": {"accuracy": {"mean": ft}, "figure1": [{"accuracy": 10.0}]}}}

    claim, why = ft_story(res(50.82, 57.98, 30.0), 5)
    assert "holds here" in claim and "7.16 points below its round-0 head" in why
    (claim,) = ft_story(res(60.0, 57.98, 61.0), 5)  # above its head: nothing to explain; the claim fails
    assert "does not hold here" in claim


def test_describing_an_algorithm_waits_for_torch_once_per_version_of_the_sources(tmp_path):
    """`fedheads algorithms NAME` needs every algorithm module (torch) the first time; after that
    the text comes from a cache keyed by the sources' sha256, with torch never imported, and it
    is the same text."""
    import subprocess
    import sys

    code = ("import sys\nfrom fedheads.run.settings import describe\n"
            "print(describe(sys.argv[1], False, sys.argv[2] == 'json'))\nprint('torch' in sys.modules)\n")
    env = {**__import__("os").environ, "FEDHEADS_CACHE": str(tmp_path / "cache")}
    for name, form in (("fed3r", "text"), ("fedavg", "json")):
        first = subprocess.run([sys.executable, "-c", code, name, form], env=env, capture_output=True, text=True,
                               timeout=300)
        again = subprocess.run([sys.executable, "-c", code, name, form], env=env, capture_output=True, text=True,
                               timeout=300)
        assert first.returncode == 0 and again.returncode == 0, (first.stderr, again.stderr)
        text, imported = first.stdout.rsplit("\n", 2)[0], first.stdout.split("\n")[-2]
        assert imported == "True" and again.stdout == text + "\nFalse\n"
        assert ("lam" in text) if name == "fed3r" else ('"settings"' in text)
    assert len(list((tmp_path / "cache" / "settings").glob("*.json"))) == 1


def test_the_settings_cache_is_keyed_by_the_sources(tmp_path, monkeypatch):
    from fedheads.run import settings

    monkeypatch.setenv("FEDHEADS_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(settings, "_source_key", lambda: "a" * 64)
    assert settings._remembered(("x",), lambda: calls.append(1) or "one") == "one"
    assert settings._remembered(("x",), lambda: calls.append(1) or "two") == "one" and calls == [1]
    monkeypatch.setattr(settings, "_source_key", lambda: "b" * 64)  # an edited source: computed again
    assert settings._remembered(("x",), lambda: calls.append(1) or "two") == "two" and calls == [1, 1]
    monkeypatch.setattr(settings, "_source_key", lambda: None)  # an installed plugin: never cached
    assert settings._remembered(("x",), lambda: "three") == "three"
    (tmp_path / "settings" / f"{'b' * 32}.json").write_text("{not json")  # a damaged file: recomputed
    monkeypatch.setattr(settings, "_source_key", lambda: "b" * 64)
    assert settings._remembered(("x",), lambda: "four") == "four"
