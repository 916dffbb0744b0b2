"""Which participants of a round the vectorised engine stacks into one call on a bucketed
federation (core/engine.py participant_groups).

A bucketed layout (core/federation.py) holds clients in size buckets padded to at most 10 % over
their rows, so a federation with skewed (power-law) sizes has dozens of buckets. A round that
draws a fraction of the clients finds a few participants in each of many buckets, and one
stacked call per bucket costs its fixed setup (schedule, copies, write-back) and, above all,
its own sequence of local steps: the round takes the sum over buckets of each bucket's longest
client, where one call takes only the longest client's steps (core/train.py steps only the
clients still stepping). So the round's per-bucket participant sets ("units") are merged,
smallest first, into groups whose padding stays bounded:

- a group's padded rows (train + test, as the layout counts them) are at most
  (1 + ROUND_WASTE) x its real rows: with 1.0, at most twice the rows its clients hold, so the
  padding a call copies, and the client-steps of an algorithm that steps every stacked client
  (masked) rather than only those still stepping, stay within about 2x (3x counting each
  client's last partial batch) of the real work;
- no group holds more padded feature bytes than GROUP_BYTES or more clients than GROUP_CLIENTS
  (LayoutConfig's default bucket limits), or than the layout's largest bucket where that is
  larger: a call's temporaries stay those of a bucket the layout could have made;
- no group holds more than GROUP_STATE_BYTES of client state (its clients x one client's rows
  of the state): a call holds a few blocks of that size at once (its clients' rows of the state,
  local training's private copy of their models, their messages), and glibc maps every block
  over 32 MiB afresh and unmaps it when freed, and hands freed heap over 64 MiB back to the OS, so
  the kernel zero-fills such blocks page by page in every call (fedheads/run/allocator.py); at
  16 MiB, three of them stay within both and are reused from the heap, as the small calls of one
  bucket's participants are. At MLP-sized heads those page faults cost more than the calls
  merging saves. A unit over the bound alone keeps its own call;
- a bucket that takes part whole with more than one client keeps its own call on its stored
  tensors (no copy; at full participation the grouping is the layout's own).

A client's batches, noise and initial state are keyed by its global id (core/rng.py,
core/batching.py), every local step gathers [clients, batch] rows, and the messages reach the
server in participant order whatever the groups. A client's numbers can still move by float
rounding: torch's CPU kernels pick their code path by the stacked shapes (a GEMM of one row, a
GEMM split over threads when it is the only one in the batch, row passes over the padded rows),
so a client's result already depended, at that level, on which clients of its bucket took part.
tests/test_grouping.py checks the merged calls against one call per bucket."""

from __future__ import annotations

from collections.abc import Sequence

# a merged group's padded rows are at most (1 + ROUND_WASTE) x its real rows; None: one call per
# storage bucket's participants (no merging)
ROUND_WASTE: float | None = 1.0
GROUP_BYTES = 64 << 20  # padded train + test feature bytes of a merged group at most (or the largest bucket's)
GROUP_CLIENTS = 64  # clients of a merged group at most (or the largest bucket's)
GROUP_STATE_BYTES = 16 << 20  # bytes of a merged group's rows of the client state at most (a unit over it: its own call)


def merge_units(units: Sequence[Sequence[int]], whole: Sequence[bool], n_train: Sequence[int],
                n_test: Sequence[int], max_rows: int, max_clients: int, waste: float | None) -> list[list[int]]:
    """Groups of unit indices, each group one stacked call (module docstring). `units`: client
    positions of the round's participants per storage bucket; `whole[u]`: unit u is all of its
    bucket; `max_rows` / `max_clients`: a group's padded rows and clients at most; `waste`: the
    engine passes ROUND_WASTE (None: one group per unit). Greedy over the units in order of their
    largest client: the open group takes the next unit while the bounds hold."""
    if waste is None or len(units) < 2:
        return [[u] for u in range(len(units))]
    if waste < 0:
        raise ValueError(f"waste {waste}: must be >= 0")

    def size(u: int) -> tuple[int, int, int]:
        return max(n_train[i] for i in units[u]), max(max(n_test[i] for i in units[u]), 1), u

    out: list[list[int]] = []
    cur: list[int] = []
    k = a = b = real = 0  # the open group: clients, largest train, largest test (>= 1), real rows
    closed = True  # the open group takes no more units (a whole bucket of several clients)
    for u in sorted(range(len(units)), key=size):
        ua, ub, _ = size(u)
        uk, ureal = len(units[u]), sum(n_train[i] + max(n_test[i], 1) for i in units[u])
        fixed = whole[u] and uk > 1
        na, nb, nk, nreal = max(a, ua), max(b, ub), k + uk, real + ureal
        rows = nk * (na + nb)
        if not (closed or fixed) and nk <= max_clients and rows <= max_rows and rows <= (1.0 + waste) * nreal:
            cur.append(u)
            k, a, b, real = nk, na, nb, nreal
            continue
        if cur:
            out.append(cur)
        cur, k, a, b, real, closed = [u], uk, ua, ub, ureal, fixed
    out.append(cur)
    return out


def max_clients(bucket_clients: Sequence[int], client_bytes: int) -> int:
    """Clients of a merged group at most: GROUP_CLIENTS (or the largest bucket's), and no more
    than hold GROUP_STATE_BYTES of client state at `client_bytes` per client."""
    most = max(GROUP_CLIENTS, *bucket_clients)
    return most if client_bytes <= 0 else min(most, max(1, GROUP_STATE_BYTES // client_bytes))
