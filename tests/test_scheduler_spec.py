"""The one parser of a scheduler spec (embedcache.distributed.local_workers), shared by
`embedcache extract --scheduler` and the pipelines' sweeps."""

import pytest

from embedcache.distributed import dask_client, local_workers
from embedcache.errors import UserError


def test_local_n_is_its_worker_count_and_an_address_is_none():
    assert local_workers("local:3") == 3
    assert local_workers("tcp://127.0.0.1:8786") is None and local_workers("tls://h:1") is None


@pytest.mark.parametrize("spec", ["local:0", "local:x", "local:", "127.0.0.1:8786", "serial"])
def test_anything_else_is_one_line(spec):
    with pytest.raises(UserError, match="scheduler"):
        local_workers(spec)


def test_dask_client_refuses_a_bad_spec_before_starting_anything():
    pytest.importorskip("distributed")
    with pytest.raises(UserError, match="want local:N with N >= 1"), dask_client("local:0"):
        pass


def test_the_sweeps_accept_serial_and_refuse_through_the_same_parser():
    from pipelines.sweep import parse_scheduler

    assert parse_scheduler("serial") == "serial" and parse_scheduler("local:2") == "local:2"
    assert parse_scheduler("tcp://h:1") == "tcp://h:1"
    with pytest.raises(UserError, match="use serial, local:N"):
        parse_scheduler("local:0")
