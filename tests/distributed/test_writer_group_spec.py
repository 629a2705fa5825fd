"""What a torchrun rank hands its writer process (engine.distributed.writer_group_spec): the store
to meet on, refused by name where there is none, and a spec that survives the pipe's msgpack."""

from __future__ import annotations

import datetime

import msgpack
import pytest

from engine.distributed.commit import GroupCommit
from engine.distributed.environment import WRITER_GROUP_TIMEOUT, DistributedContext
from engine.distributed.writer_group_spec import MODULE, NAMESPACE, WriterGroupSpec, store_address
from engine.errors import ConfigError


@pytest.mark.parametrize("environ, missing", [
    ({}, "MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_ADDR": "10.0.0.1"}, "MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "not-a-port"}, "MASTER_ADDR and MASTER_PORT"),
])
def test_a_group_without_a_store_to_meet_on_is_refused_by_name(environ, missing):
    with pytest.raises(ConfigError, match=missing) as raised:
        store_address(environ)
    assert "writer='thread'" in str(raised.value)


def test_the_store_address_is_the_one_the_ranks_met_on():
    assert store_address({"MASTER_ADDR": "node-3", "MASTER_PORT": "29500"}) == ("node-3", 29500)


def test_a_ranks_spec_names_its_try_and_where_its_committer_takes_up(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    context = DistributedContext(rank=1, world_size=4, local_rank=1, device="cpu", writer_group=None,  # type: ignore[arg-type]
                                 attempt=3_000_000_042)
    committer = GroupCommit(context)
    committer.take_over({"next_sequence": 17})
    data = committer.writer_process_spec()
    through_the_pipe = msgpack.unpackb(msgpack.packb(data), strict_map_key=False)
    spec = WriterGroupSpec.from_dict(through_the_pipe)
    assert (spec.rank, spec.world_size, spec.host, spec.port) == (1, 4, "127.0.0.1", 29511)
    assert spec.namespace == f"{NAMESPACE}/3000000042" and spec.attempt == 3_000_000_042
    assert spec.committer == {"next_sequence": 17, "local_tier": None}
    assert spec.module == MODULE
    assert datetime.timedelta(seconds=spec.timeout_s) == WRITER_GROUP_TIMEOUT
    other_try = GroupCommit(DistributedContext(1, 4, 1, "cpu", None, 3_000_000_043))  # type: ignore[arg-type]
    assert WriterGroupSpec.from_dict(other_try.writer_process_spec()).namespace != spec.namespace
