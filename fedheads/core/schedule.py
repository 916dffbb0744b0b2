"""When a run evaluates: the one rule every driver follows (the head engine, live fine-tuning and
FedDRA, Flower), so `--eval-every k` means the same in every command. Standard library only."""

from __future__ import annotations


def evaluated(r: int, rounds: int, every: int) -> bool:
    """Whether round `r` (1-based) of `rounds` is evaluated: every `every`-th and the last one
    (`every` = 0: the last only). A command that starts from a trained model evaluates it too, as
    round 0: that is the driver's, not this rule's."""
    return r == rounds or (every > 0 and r % every == 0)
