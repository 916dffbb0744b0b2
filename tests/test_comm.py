"""Communication accounting: measured ledger, and the papers' published figures reproduced
from the architecture (FedPCL Tables 2 and 14, FedNCM Table 2 / Appendix A)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedcache.errors import UserError
from fedheads.report import communication as C


@pytest.mark.parametrize("k,fedavg,fedrep", [(1, 133_632, 131_072), (3, 395_776, 393_216)])
def test_fedpcl_table2_comm_params(k, fedavg, fedrep):
    arch = C.HeadArch(backbone_dims=(512,) * k, proj_dim=256, num_classes=10)
    for m in ("FedAvg", "pFedMe", "PerFedAvg", "Per-FedAvg"):
        assert C.fedpcl_comm_params(m, arch) == fedavg
    assert C.fedpcl_comm_params("FedRep", arch) == fedrep
    assert C.fedpcl_comm_params("FedProto", arch) == 2_560
    assert C.fedpcl_comm_params("FedPCL", arch) == 2_560
    assert C.fedpcl_comm_params("Solo", arch) == 0


def test_fedpcl_table14_trainable_params():
    got = [C.fedpcl_trainable_params(C.HeadArch(backbone_dims=(512,) * k)) for k in (1, 2, 3)]
    assert got == [133_632, 264_704, 395_776]


def test_unknown_method_is_user_error():
    with pytest.raises(UserError, match="method='scaffold'"):
        C.fedpcl_comm_params("scaffold", C.HeadArch())


def test_fedncm_appendix_a_example():
    # 10 classes x 512-d x 100 clients, one round, 32 bit, up and down
    assert C.comm_fedncm_bytes(512, 10, 100) == 4.096e6
    assert C.paper_total_bytes(C.fedpcl_comm_params("fedncm", C.HeadArch()), 100, 1) == 4.096e6


GB = 1e9
P = C.FEDNCM_TABLE2_BASE_PARAMS


@pytest.mark.parametrize("classes,rounds,gb", [
    (10, 3000, 1803.71), (102, 3000, 1916.76), (200, 3000, 2037.18),   # Random
    (196, 3500, 2370.97), (10, 3500, 2104.32),
    (10, 200, 120.25), (102, 250, 159.73), (200, 1000, 679.06),        # FT
    (196, 1000, 677.42), (10, 1000, 601.24),
])
def test_fedncm_table2_full_model_rows(classes, rounds, gb):
    assert round(C.comm_ft_bytes(512, classes, P, 100, rounds) / GB, 2) == gb


@pytest.mark.parametrize("classes,rounds,gb", [(10, 200, 120.25), (102, 250, 159.73),
                                               (200, 1000, 679.06), (10, 500, 300.62)])
def test_fedncm_plus_ft_rows(classes, rounds, gb):
    assert round(C.comm_fedncm_ft_bytes(512, classes, P, 100, rounds) / GB, 2) == gb
    with_ncm = C.comm_fedncm_ft_bytes(512, classes, P, 100, rounds, include_ncm_round=True)
    assert with_ncm - C.comm_ft_bytes(512, classes, P, 100, rounds) == C.comm_fedncm_bytes(
        512, classes, 100)


@pytest.mark.parametrize("classes,rounds,gb,bias", [
    (10, 1000, 4.10, False), (200, 1500, 122.88, False), (196, 2500, 200.70, False),
    (102, 500, 20.93, True),   # the one LP figure that counts the bias (module doc)
])
def test_fedncm_table2_lp_rows(classes, rounds, gb, bias):
    assert round(C.comm_lp_bytes(512, classes, 100, rounds, include_bias=bias) / GB, 2) == gb


def test_fedncm_flowers_lp_without_bias_differs():
    assert round(C.comm_lp_bytes(512, 102, 100, 500) / GB, 2) == 20.89


@pytest.mark.parametrize("classes,gb", [(10, 4.1e-3), (102, 4.2e-2), (200, 8.2e-2), (196, 8.0e-2)])
def test_fedncm_table2_ncm_rows(classes, gb):
    assert float(f"{C.comm_fedncm_bytes(512, classes, 100) / GB:.1e}") == gb


def test_fedncm_table2_compute():
    assert C.comp_ft(200, 1, 50_000) == 3.0e7        # CIFAR-10 FT
    assert C.comp_ft(3000, 1, 50_000) == 4.5e8       # CIFAR-10 Random
    assert C.comp_lp(1500, 1, 5_994) == pytest.approx(9.0e6, rel=0.01)   # CUB LP
    assert C.comp_lp(2500, 1, 8_144) == pytest.approx(2.0e7, rel=0.02)   # Cars LP
    assert C.comp_fedncm(50_000) == 50_000


def test_fraction_and_bits_scale():
    full = C.comm_lp_bytes(512, 10, 100, 10)
    assert C.comm_lp_bytes(512, 10, 100, 10, fraction=0.3) == pytest.approx(0.3 * full)
    assert C.comm_lp_bytes(512, 10, 100, 10, bits=16) == full / 2
    with pytest.raises(UserError, match="fraction=0"):
        C.paper_total_bytes(1, 1, 1, fraction=0.0)


def test_fedpcl_paper_comm_downloads_every_clients_set():
    # 5 clients, 10 classes, d = 256, 50 rounds: up C*d = 2,560 per client and round; down
    # (m+1)*C*d = 15,360 in the 49 rounds after the collection round 0; 32 bit
    arch = C.HeadArch((512,), 256, 10)
    rc = C.paper_round_comm("FedPCL", arch, clients=5)
    assert (rc.upload, rc.download, rc.silent_rounds) == (2_560, 15_360, 1)
    up, down = C.paper_comm_bytes("FedPCL", arch, 5, 50)
    assert up == 2_560 * 5 * 50 * 4 == 2.56e6
    assert down == 15_360 * 5 * 49 * 4 == 15.0528e6
    assert up + down == pytest.approx(17.6128e6)
    assert C.paper_total_bytes(2_560, 5, 50) == 5.12e6  # the symmetric form undercounts
    # methods that receive what they send keep the symmetric FedNCM Eq. 3 total
    for m in ("FedAvg", "FedProto", "fedncm", "lp"):
        u, d = C.paper_comm_bytes(m, arch, 5, 50)
        assert u == d and u + d == C.paper_total_bytes(C.fedpcl_comm_params(m, arch), 5, 50)


def test_fedpcl_measured_traffic_is_the_convention_plus_counts_and_flags():
    # the same 5 x 10 x 256 x 50 run measured by the engine: 17.64 MB; the 27,200 bytes over
    # the convention are the uploads' float32 counts + bool flags (250 x 50 B) and the
    # downloads' presence flags (245 x (5+1) x 10 B)
    from fed_tiny import tiny_fed

    from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
    from fedheads.core import run

    res = run(FedPCL(FedPCLConfig(hidden=256, batch_size=32)), tiny_fed(M=5, D=4, C=10), rounds=50,
              seed=0, eval_every=0, progress=False)
    led = C.ledger_from_rounds(res.history).summary()
    assert led["upload_bytes_total"] == 250 * (2_560 * 4 + 10 * 4 + 10)
    assert led["download_bytes_total"] == 245 * (15_360 * 4 + 60)
    assert led["upload_bytes_total"] + led["download_bytes_total"] == 17.64e6
    up, down = C.paper_comm_bytes("fedpcl", C.HeadArch((4,), 256, 10), 5, 50)
    assert 17.64e6 - (up + down) == 250 * 50 + 245 * 60


def test_message_size_numpy_and_torch():
    msg = {"sums": np.zeros((4, 3, 8), np.float64), "counts": torch.zeros(4, 3, dtype=torch.int64)}
    assert C.message_size(msg) == (4, 3 * 8 + 3, 3 * 8 * 8 + 3 * 8)
    with pytest.raises(UserError, match="leading axis"):
        C.message_size({"a": np.zeros((4, 2)), "b": np.zeros((3, 2))})
    with pytest.raises(UserError, match="empty"):
        C.message_size({})


def test_ledger_sums_over_rounds_and_participants():
    led = C.CommLedger()
    for r in range(3):
        led.add_message(r, "up", {"w": np.zeros((5, 10, 4), np.float32)})       # 5 clients x 40
        led.add_message(r, "down", {"w": np.zeros((1, 10, 4), np.float32)}, receivers=5)
    led.add_message(3, "up", {"w": np.zeros((2, 10, 4), np.float32)})           # 2 participants
    s = led.summary()
    assert s["upload_params_total"] == 40 * 17
    assert s["upload_bytes_total"] == 160 * 17
    assert s["download_bytes_total"] == 160 * 15
    assert s["upload_params_per_client_per_round"] == 40.0
    assert s["rounds_communicating"] == 4
    with pytest.raises(UserError, match="direction='sideways'"):
        led.add(0, "sideways", 1, 1, 1)


def test_ledger_from_engine_round_records():
    from types import SimpleNamespace as NS

    recs = [NS(round=0, participants=(0, 1, 2), comm=NS(up_values=30, up_bytes=120,
                                                       down_values=15, down_bytes=60)),
            NS(round=1, participants=(1,), comm=NS(up_values=10, up_bytes=40,
                                                  down_values=5, down_bytes=20))]
    s = C.ledger_from_rounds(recs).summary()
    assert s["upload_params_per_client_per_round"] == 10.0
    assert (s["upload_bytes_total"], s["download_bytes_total"]) == (160, 80)
    assert s["rounds_communicating"] == 2
