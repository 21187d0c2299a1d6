"""A standby's read-only view of the KV pool (engine_shim.kvreader) against a
real GMS server process: it waits for a pool, maps the pages of what is
sealed in it (not the whole pool), follows it as it grows and across GMS's
death (the new GMS's pool is another), and is handed over only for the pool
the wake was granted. The holder here is this process's own KvPool, through
a read-write session of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gmsprocs import Gms
from procs import wait_for

from understudy.engine_shim import kvlog
from understudy.engine_shim.kvpool import KvPool
from understudy.engine_shim.kvreader import KvReader
from understudy.gms.kvclient import KvSession

pytestmark = pytest.mark.process

# 2 layers, 2 heads of 512 floats: a position of a head is 2 KiB, so a head's
# 64 positions of a slot are 32 pages, apart from every other head's.
SPEC = kvlog.PoolSpec("m", layers=2, kv_heads=2, head_dim=512, dtype="float32", slots=4, max_len=64)
TOKENS = list(range(100, 164))


@pytest.fixture
def reader(gms: Gms) -> Iterator[KvReader]:
    r = KvReader(gms.path(), SPEC, "standby", every_s=0.05, follow_s=0.02)
    yield r
    r.close()


def holder(gms: Gms, epoch: int) -> tuple[KvSession, KvPool]:
    req = {"size": SPEC.pool_bytes, "spec": SPEC.digest().hex(), "timeout": 5.0}
    session = KvSession.acquire(gms.path(), epoch=epoch, name=f"e{epoch}", **req)
    return session, KvPool(session.view(), SPEC, epoch)


def write(pool: KvPool, slot: int, n: int, seed: int, tokens: list[int] = TOKENS) -> None:
    """What an engine does: claim, write ``n`` positions, seal them."""
    pool.claim(tokens[:n], [slot], prompt=n, chunk=16)
    rng = np.random.default_rng(seed)
    pool.k[:, slot, :, :n] = rng.standard_normal((2, 2, n, 512), dtype=np.float32)
    pool.v[:, slot, :, :n] = rng.standard_normal((2, 2, n, 512), dtype=np.float32)
    pool.seal(slot, tokens, 0, n)


def present_kib(address: int) -> int:
    """The pages of this process's mapping at ``address`` in its page tables (Rss)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{address:x}-"))
    rss = next(ln for ln in lines[start + 1 :] if ln.startswith("Rss:"))
    return int(rss.split()[1])


def test_the_view_maps_what_is_sealed_and_follows_the_pool(
    gms: Gms, reader: KvReader, tmp_path: Path
) -> None:
    server = gms.server(0, "--lock-state", "none")
    reader.start()
    time.sleep(0.5)  # ten asks, each refused: no pool yet
    assert not reader.mapped

    rw, pool = holder(gms, 1)
    write(pool, 0, 40, seed=1)
    wait_for(lambda: reader.mapped, 10, what="the view")
    view = reader._session
    assert view is not None
    position_kib = SPEC.head_dim * 4 // 1024
    # The sealed positions' pages: 40 positions of 4 heads' keys and values
    # (and the log's and header's pages), not the pool's 4 slots of 64.
    sealed_kib = 40 * position_kib * 2 * 2 * 2
    wait_for(lambda: present_kib(view.address) >= sealed_kib, 10, what="the sealed pages")
    assert present_kib(view.address) < sealed_kib + 1024 < SPEC.pool_bytes // 1024
    write(pool, 1, 64, seed=2)  # the pool grows: the next pass maps the new pages
    sealed_kib += 64 * position_kib * 2 * 2 * 2
    wait_for(lambda: present_kib(view.address) >= sealed_kib, 10, what="the new pages")
    assert gms.state()["kv"]["readers"] == 1
    # Slot 3 churns, a prompt of one block then another, more records than
    # the ring holds while the reader is kept from passing (its pass lock), so
    # it falls a ring behind and reads it whole; then a prompt of the slot.
    with reader._pass:
        for i in range(SPEC.log_capacity):
            write(pool, 3, 16, seed=10 + i, tokens=[1000 + i] * 64)
    write(pool, 3, 64, seed=4, tokens=[7] * 64)
    sealed_kib += 64 * position_kib * 2 * 2 * 2
    wait_for(lambda: present_kib(view.address) >= sealed_kib, 10, what="the churned slot")

    # GMS dies: its pool goes with it (the holder keeps its mapping); the
    # view is dropped and the new GMS's pool, once made, mapped instead.
    server.kill9()
    wait_for(lambda: not reader.mapped, 10, what="the view dropped")
    rw.close()
    gms.procs.remove(server)
    gms.path().unlink(missing_ok=True)
    gms.server(0, "--lock-state", "none")
    rw, pool = holder(gms, 2)
    assert rw.created
    write(pool, 2, 16, seed=3)
    wait_for(lambda: reader.mapped, 10, what="the new pool's view")

    session = reader.take(rw.allocation_id)
    assert session is not None and not session.writable
    view_bytes = session.view()
    assert view_bytes.readonly
    seen = KvPool(rw.view(), SPEC, 3, reader=view_bytes)  # the next engine, reading through it
    assert np.array_equal(seen.rk[:, 2, :, :16], pool.k[:, 2, :, :16])
    pool.k[0, 2, 0, 0, 0] += 1.0  # a write through the pool, seen through the view at once
    assert seen.rk[0, 2, 0, 0, 0] == pool.k[0, 2, 0, 0, 0]
    session.close()
    rw.close()


def test_a_view_of_another_pool_is_not_handed_over(gms: Gms, reader: KvReader) -> None:
    gms.server(0, "--lock-state", "none")
    rw, _ = holder(gms, 1)
    reader.start()
    wait_for(lambda: reader.mapped, 10, what="the view")
    assert reader.take(rw.allocation_id + 1) is None
    assert not reader.mapped
    wait_for(lambda: gms.state()["kv"]["readers"] == 0, 10, what="the view closed")
    rw.close()


def test_each_pass_that_read_a_record_tells_the_engine_what_the_log_says(gms: Gms) -> None:
    """The engine's copies ahead of a kill (`FollowsKvPool`) are told, after
    each pass that read a record, the read-only view and the index of the
    whole log: the holder's own, whether the pass read only the records
    appended since the last (a slot sealed, another retired and sealed
    again) or the ring whole (it fell a ring behind)."""
    told: list[tuple[bool, dict[tuple[int, int], kvlog.Sealed]]] = []
    # Asked once every 5 s while there is no pool; followed every 20 ms from
    # the view's making on (its first pass too: a kill may come within a second).
    reader = KvReader(
        gms.path(), SPEC, "standby", every_s=5.0, follow_s=0.02,
        on_pass=lambda view, index: told.append((view.readonly, dict(index.sealed))),
    )  # fmt: skip
    gms.server(0, "--lock-state", "none")
    rw, pool = holder(gms, 1)
    try:
        reader.start()
        wait_for(lambda: told, 2, what="the view made: its log read whole, empty")
        assert told == [(True, {})]
        write(pool, 0, 40, seed=1)
        wait_for(lambda: told[-1][1] == pool.index.sealed, 2, what="the first seals")
        write(pool, 1, 64, seed=2)
        write(pool, 0, 16, seed=3, tokens=[5] * 64)  # slot 0 retired, sealed again
        wait_for(lambda: told[-1][1] == pool.index.sealed, 2, what="the records since")
        passes = len(told)
        time.sleep(0.3)  # fifteen passes, nothing new: none told
        assert len(told) == passes
        with reader._pass:  # a ring's worth of records before the next pass
            for i in range(SPEC.log_capacity):
                write(pool, 3, 16, seed=10 + i, tokens=[1000 + i] * 64)
        wait_for(lambda: told[-1][1] == pool.index.sealed, 10, what="the ring read whole")
        assert all(readonly for readonly, _ in told)
    finally:
        reader.close()
        rw.close()
