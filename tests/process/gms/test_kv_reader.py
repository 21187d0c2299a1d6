"""A standby's read-only view of the KV pool (engine_shim.kvreader) against a
real GMS server process: it waits for a pool, maps it with the holder's bytes,
follows it across GMS's death (the new GMS's pool is another), and is handed
over only for the pool the wake was granted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from devmem import pattern
from gmsprocs import Gms
from procs import wait_for
from test_gms_kv import MiB, acquire, lock_record

from understudy.engine_shim.kvreader import KvReader

pytestmark = pytest.mark.process


@pytest.fixture
def reader(gms: Gms) -> Iterator[KvReader]:
    r = KvReader(gms.path(), 3 * MiB, "spec", "standby", every_s=0.05)
    yield r
    r.close()


def holds(view: memoryview, seed: int) -> bool:
    words = np.frombuffer(view, dtype=np.uint64)
    return bool(np.array_equal(words, pattern(0, len(words), seed)))


def test_the_view_follows_the_pool_and_is_handed_over_for_it_only(
    gms: Gms, reader: KvReader, tmp_path: Path
) -> None:
    lock_state = tmp_path / "lock.state"
    server = gms.server(0, "--lock-state", str(lock_state))
    reader.start()
    time.sleep(0.5)  # ten asks, each refused: no pool yet
    assert not reader.mapped

    lock_record(lock_state, "e1", 1)
    holder = gms.agent("holder")
    assert acquire(holder, gms, 1, "e1")["ok"]
    holder.ok("kv_fill", seed=5)
    wait_for(lambda: reader.mapped, 10, what="the view")
    assert gms.state()["kv"]["readers"] == 1

    # GMS dies: its pool goes with it (the holder keeps its mapping); the
    # view is dropped and the new GMS's pool, once made, mapped instead.
    server.kill9()
    wait_for(lambda: not reader.mapped, 10, what="the view dropped")
    gms.procs.remove(server)
    gms.path().unlink(missing_ok=True)
    gms.server(0, "--lock-state", str(lock_state))
    lock_record(lock_state, "e2", 2)
    second = gms.agent("second")
    got = acquire(second, gms, 2, "e2")
    assert got["ok"] and got["created"], got
    second.ok("kv_fill", seed=7)
    wait_for(lambda: reader.mapped, 10, what="the new pool's view")

    session = reader.take(got["allocation_id"])
    assert session is not None and not session.writable
    view = session.view()
    assert view.readonly and holds(view, 7)
    second.ok("kv_fill", seed=8)  # the holder's writes, seen through the view at once
    assert holds(view, 8)
    session.close()


def test_a_view_of_another_pool_is_not_handed_over(gms: Gms, reader: KvReader) -> None:
    gms.server(0, "--lock-state", "none")
    holder = gms.agent("holder")
    got = acquire(holder, gms, 1, "e1")
    assert got["ok"], got
    reader.start()
    wait_for(lambda: reader.mapped, 10, what="the view")
    assert reader.take(got["allocation_id"] + 1) is None
    assert not reader.mapped
    wait_for(lambda: gms.state()["kv"]["readers"] == 0, 10, what="the view closed")
