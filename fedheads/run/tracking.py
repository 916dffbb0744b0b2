"""Optional experiment tracking: TensorBoard event files (`fedheads train/compare --tensorboard`).

Behind the `[tensorboard]` extra (tensorboardX: event files with numpy and protobuf only, no
TensorFlow and no tensorboard server needed to write them). Per seed, RUN_DIR/tensorboard/seed<S>/
gets one point per round (step = round, 1-based) as soon as the round is done:

    accuracy/mean, accuracy/worst     client-average and worst-client test accuracy (percent, clients
                                      with test samples; rounds that were not evaluated have none)
    accuracy/<rule>                   client-average accuracy of the algorithm's other rules (global_model)
    communication/upload_bytes, communication/download_bytes   sent in the round (all participants)
    communication/total_bytes         cumulative up + down since round 1
    time/train_seconds                the round's training wall time

The engines record no training loss (the algorithm protocol returns none), so none is logged.
`tensorboard --logdir RUN_DIR` (a comparison: CMP_DIR) shows every seed and algorithm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedcache.errors import UserError

INSTALL = "pip install 'fedfrozen[tensorboard]' (or pip install tensorboardX)"


def require() -> None:
    """UserError (one line saying what to install) when the extra is missing."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise UserError(f"--tensorboard: the [tensorboard] extra is not installed; {INSTALL}") from None


class RoundLogger:
    """Writes one seed's per-round scalars (see the module docstring); call it with each
    fedheads.core.engine.RoundRecord, then `close()`."""

    def __init__(self, log_dir: Path, seed: int, algorithm: str) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(Path(log_dir) / f"seed{seed}"), comment=f" {algorithm} seed {seed}")
        self.total = 0

    def __call__(self, rec: Any) -> None:
        step, w = rec.round + 1, self.writer
        if rec.accuracy is not None:
            for rule, acc in rec.accuracy.items():
                acc = acc[~acc.isnan()]
                if not len(acc):
                    continue
                if rule == "main":
                    w.add_scalar("accuracy/mean", 100.0 * float(acc.mean()), step)
                    w.add_scalar("accuracy/worst", 100.0 * float(acc.min()), step)
                else:
                    w.add_scalar(f"accuracy/{rule}", 100.0 * float(acc.mean()), step)
        self.total += rec.comm.up_bytes + rec.comm.down_bytes
        w.add_scalar("communication/upload_bytes", rec.comm.up_bytes, step)
        w.add_scalar("communication/download_bytes", rec.comm.down_bytes, step)
        w.add_scalar("communication/total_bytes", self.total, step)
        w.add_scalar("time/train_seconds", rec.seconds, step)
        w.flush()  # a killed run keeps every round it logged

    def start_from(self, history: list[Any]) -> None:
        """A resumed run: the cumulative total continues from the checkpoint's rounds."""
        self.total = sum(r.comm.up_bytes + r.comm.down_bytes for r in history)

    def close(self) -> None:
        self.writer.close()
