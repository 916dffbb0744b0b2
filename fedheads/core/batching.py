"""Deterministic per-client mini-batch schedules, identical in the vectorised and loop engines.

Each client i shuffles its own n_i training rows every epoch with keys from the counter-based
hash of (seed, round, client global index, epoch, row), so the order does not depend on which
other clients are stacked with it. It takes ceil(n_i / B) steps per epoch; the last batch is
partial and masked (no drop_last: a rare class never vanishes, unlike the FedPCL code).
`drop_last=True` (offered for the FedPCL code variant) takes floor(n_i / B) full batches and
drops the rest of each epoch's shuffle, as torch's DataLoader(drop_last=True) does. The
vectorised engine runs max_i steps and marks a client inactive once its own steps are done."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedheads.core import rng


@dataclass(frozen=True)
class Schedule:
    """Batches for all local steps of a round."""

    index: torch.Tensor  # [S, M, B] int64 row indices into the client's padded train arrays
    valid: torch.Tensor  # [S, M, B] bool: row is a real sample (last batch of an epoch is partial)
    active: torch.Tensor  # [S, M] bool: the client still has a batch at step s
    rows: tuple[torch.Tensor, ...]  # per step: [A_s] int64 active clients (built on the host, no sync)
    ids: tuple[tuple[int, ...], ...]  # per step: the same active clients as host ints
    totals: tuple[int, ...] = ()  # per client: its number of steps (host ints)

    @property
    def num_steps(self) -> int:
        return int(self.index.shape[0])


def make_schedule(n_train: list[int], client_index: torch.Tensor, batch_size: int, epochs: int,
                  seed: int, round_: int, device: torch.device | str = "cpu",
                  drop_last: bool = False) -> Schedule:
    """Schedule for clients with n_train[i] rows (global ids client_index[i])."""
    M = len(n_train)
    nmax = max(n_train)
    B = batch_size
    steps_per_epoch = [n // B if drop_last else (n + B - 1) // B for n in n_train]
    S = max(s * epochs for s in steps_per_epoch)
    n_t = torch.tensor(n_train, dtype=torch.int64, device=device)
    spe = torch.tensor(steps_per_epoch, dtype=torch.int64, device=device)
    # shuffle keys [M, E, Nmax]; padding rows sort last (keys are < 2**32)
    ep = torch.arange(epochs, device=device).view(1, epochs, 1)
    row = torch.arange(nmax, device=device).view(1, 1, nmax)
    cid = client_index.to(device).view(M, 1, 1)
    keys = rng.hash_keys(seed, round_, cid, ep, row)
    keys = torch.where(row < n_t.view(M, 1, 1), keys, torch.full_like(keys, 1 << 40))
    perm = torch.argsort(keys, dim=-1, stable=True)  # [M, E, Nmax]
    s = torch.arange(S, device=device).view(S, 1)
    spe1 = spe.clamp_min(1)  # drop_last gives 0 steps to a client with n_i < B: never active
    epoch = torch.div(s, spe1.view(1, M), rounding_mode="floor")  # [S, M]
    k = s - epoch * spe1.view(1, M)
    active = (epoch < epochs) & (spe > 0).view(1, M)
    pos = k.unsqueeze(-1) * B + torch.arange(B, device=device).view(1, 1, B)  # [S, M, B]
    valid = (pos < (spe * B if drop_last else n_t).view(1, M, 1)) & active.unsqueeze(-1)
    e_c = epoch.clamp_max(epochs - 1)
    pos_c = pos.clamp_max(nmax - 1)
    flat = perm.view(M, epochs * nmax)
    lin = e_c.unsqueeze(-1) * nmax + pos_c  # [S, M, B]
    index = torch.gather(flat.unsqueeze(0).expand(S, M, epochs * nmax), 2, lin)
    index = torch.where(valid, index, torch.zeros_like(index))
    total = [sp * epochs for sp in steps_per_epoch]
    cache: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
    rows, ids = [], []
    for st in range(S):
        act = tuple(i for i in range(M) if st < total[i])
        if len(act) not in cache:  # clients drop out in order of their step counts
            cache[len(act)] = act, torch.tensor(act, dtype=torch.int64, device=device)
        ids.append(cache[len(act)][0])
        rows.append(cache[len(act)][1])
    return Schedule(index=index, valid=valid, active=active, rows=tuple(rows), ids=tuple(ids), totals=tuple(total))
