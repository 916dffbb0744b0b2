"""The live round loop (fedheads.finetuning.rounds.run_rounds) on a toy state: round 0 is
evaluated and saved, then every round trains once, is evaluated every `eval_every` rounds and on
the last, is saved and reported to `on_round` once; a resumed run continues after the
checkpoint's round and ends equal to an uninterrupted one; bad settings are one line."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import GlobalModel
from fedheads.core.schedule import evaluated
from fedheads.finetuning.rounds import Checkpoint, LiveRound, run_rounds, seed_timing

CPU = torch.device("cpu")


@dataclass(frozen=True)
class ToyState:
    model: GlobalModel
    count: torch.Tensor  # a non-model field: saved as the checkpoint's "opt" leaves


@dataclass
class ToyRound(LiveRound):
    value: float = 0.0
    score: float | None = None  # None: not evaluated


def _start() -> ToyState:
    return ToyState(GlobalModel({"w": torch.zeros(3)}, {"b": torch.ones(2)}), torch.zeros((), dtype=torch.int64))


class Toy:
    """The driver's two callables, logging what the loop calls."""

    def __init__(self) -> None:
        self.trained: list[int] = []
        self.evaluated: list[int] = []
        self.reported: list[int] = []

    def train(self, r: int, s: ToyState) -> tuple[ToyState, ToyRound]:
        self.trained.append(r)
        w = s.model.params["w"] * 0.5 + r  # depends on the state, so a wrong resume point shows
        return ToyState(GlobalModel({"w": w}, {"b": s.model.buffers["b"] + 1}), s.count + 1), ToyRound(r, value=float(w.sum()))

    def evaluate(self, s: ToyState, rec: ToyRound) -> dict[str, str]:
        self.evaluated.append(rec.round)
        rec.score = float(s.model.params["w"].sum())
        return {"score": f"{rec.score:.1f}"}

    def on_round(self, rec: ToyRound) -> None:
        self.reported.append(rec.round)


def _run(toy: Toy, rounds: int, eval_every: int = 1, **kw):
    return run_rounds(_start(), rounds, toy.train, toy.evaluate, ToyRound(0), device=CPU,
                      evaluates=lambda r, n: evaluated(r, n, eval_every),
                      progress=False, on_round=toy.on_round, **kw)


@pytest.mark.parametrize("eval_every,evaluated", [(1, [0, 1, 2, 3, 4, 5, 6, 7]), (3, [0, 3, 6, 7]),
                                                  (7, [0, 7]), (0, [0, 7]), (10, [0, 7])])
def test_eval_cadence_round_zero_and_the_last_always(eval_every, evaluated):
    toy = Toy()
    run = _run(toy, 7, eval_every)
    assert toy.evaluated == evaluated
    assert toy.trained == toy.reported == list(range(1, 8))  # round 0 trains nothing and is not reported
    assert [r.round for r in run.rounds] == list(range(8)) and run.resumed_from is None
    assert [r.round for r in run.rounds if r.score is not None] == evaluated
    # timings: every trained round has its train clocks, only evaluated rounds eval clocks
    assert all(r.eval_seconds == r.eval_cpu_seconds == 0.0 for r in run.rounds if r.score is None)
    assert run.rounds[0].train_seconds == 0.0 and all(r.train_seconds > 0 for r in run.rounds[1:])
    assert seed_timing(0, run)["rounds"]["train_wall_seconds"] == [r.train_seconds for r in run.rounds[1:]]
    assert int(run.state.count) == 7


def test_zero_rounds_evaluates_the_start_only():
    toy = Toy()
    run = _run(toy, 0)
    assert toy.evaluated == [0] and toy.trained == toy.reported == []
    assert run.state.model.params["w"].equal(torch.zeros(3)) and len(run.rounds) == 1


def test_each_round_is_saved_before_on_round(tmp_path):
    saved: list[int] = []
    toy = Toy()

    class Spy(Checkpoint):
        def save(self, state, rounds):
            super().save(state, rounds)
            saved.append(rounds[-1].round)

    def on_round(rec):
        assert saved[-1] == rec.round  # an observer never sees a round the checkpoint lacks
        toy.on_round(rec)

    run_rounds(_start(), 4, toy.train, toy.evaluate, ToyRound(0), device=CPU, progress=False, on_round=on_round,
               checkpoint=Spy(tmp_path / "c.pt", {"x": 1}, "toy/1", ToyRound))
    assert saved == [0, 1, 2, 3, 4] and toy.reported == [1, 2, 3, 4]


class Stop(Exception):
    pass


@pytest.mark.parametrize("killed_after", [0, 1, 3, 5])
def test_resume_continues_after_the_checkpoint_and_ends_equal(tmp_path, killed_after):
    ck = Checkpoint(tmp_path / "c.pt", {"rounds": 5}, "toy/1", ToyRound)
    ref = _run(Toy(), 5, eval_every=2)

    first = Toy()

    def train(r, s):  # killed_after 0: killed during round 1, only round 0's checkpoint exists
        if killed_after == 0:
            raise Stop
        return first.train(r, s)

    def stop(rec):
        if rec.round == killed_after:
            raise Stop
    with pytest.raises(Stop):
        run_rounds(_start(), 5, train, first.evaluate, ToyRound(0), device=CPU, evaluates=lambda r, n: evaluated(r, n, 2),
                   progress=False,
                   checkpoint=ck, on_round=stop)
    toy = Toy()
    got = _run(toy, 5, eval_every=2, checkpoint=ck, resume=True)
    assert got.resumed_from == killed_after
    assert toy.trained == toy.reported == list(range(killed_after + 1, 6))
    assert toy.evaluated == [r for r in (2, 4, 5) if r > killed_after]  # round 0 is not evaluated again
    assert [type(r) for r in got.rounds] == [ToyRound] * 6
    strip = lambda rs: [{k: v for k, v in r.as_dict().items() if "seconds" not in k} for r in rs]  # noqa: E731
    assert strip(got.rounds) == strip(ref.rounds)
    for a, b in ((got.state.model.params, ref.state.model.params), (got.state.model.buffers, ref.state.model.buffers)):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert torch.equal(got.state.count, ref.state.count)


def test_resume_without_a_checkpoint_starts_at_round_zero(tmp_path):
    toy = Toy()
    run = _run(toy, 2, checkpoint=Checkpoint(tmp_path / "none.pt", {}, "toy/1", ToyRound), resume=True)
    assert run.resumed_from is None and toy.evaluated == [0, 1, 2] and toy.trained == [1, 2]


def test_a_finished_checkpoint_runs_no_round(tmp_path):
    ck = Checkpoint(tmp_path / "c.pt", {}, "toy/1", ToyRound)
    ref = _run(Toy(), 3, checkpoint=ck)
    toy = Toy()
    got = _run(toy, 3, checkpoint=ck, resume=True)
    assert toy.trained == toy.evaluated == toy.reported == [] and got.resumed_from == 3
    assert torch.equal(got.state.model.params["w"], ref.state.model.params["w"])


def test_bad_settings_are_one_line():
    from fedheads.run.commands import FinetuneRun, TrainOptions

    for cls in (TrainOptions, FinetuneRun):  # the schedule is checked where it is declared
        with pytest.raises(UserError, match="--eval-every -1: must be >= 0"):
            cls(eval_every=-1).check_schedule()
    with pytest.raises(UserError, match="--rounds -2: must be >= 0"):
        _run(Toy(), -2)

