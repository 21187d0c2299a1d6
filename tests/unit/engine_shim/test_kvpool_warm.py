"""A pool's adopted blocks proved ahead of their claims (KvPool.warm, prove):
a claim reads again only what the proof did not find sound under the same
seal, and a block corrupt before the proof is still found by its claim and
recomputed; the proof runs on a thread of its own, then the engine's own
step, and is skipped past its byte budget."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from understudy.engine_shim import kvlog, kvpool
from understudy.engine_shim.kvpool import KvPool

SPEC = kvlog.PoolSpec("m", layers=2, kv_heads=2, head_dim=8, dtype="float32", slots=3, max_len=64)
TOKENS = list(range(1, 41))  # blocks 0 and 1 whole, block 2 with 8 positions


def adopted() -> tuple[KvPool, bytearray]:
    """A pool a first engine filled and sealed, adopted by the next."""
    memory = bytearray(SPEC.pool_bytes)
    first = KvPool(memoryview(memory), SPEC, 1)
    first.claim(TOKENS, free=[1], prompt=len(TOKENS), chunk=16)
    first.k[:, 1, :, :40] = 0.5
    first.v[:, 1, :, :40] = -0.25
    first.seal(1, TOKENS, 0, 40)
    return KvPool(memoryview(memory), SPEC, 2), memory


def counting(pool: KvPool) -> list[Sequence[tuple[int, int]]]:
    """The blocks each call of the pool's own checksums was asked for."""
    asked: list[Sequence[tuple[int, int]]] = []
    real = pool.checksums

    def checksums(slot: int, blocks: Sequence[tuple[int, int]]) -> list[int]:
        asked.append(list(blocks))
        return real(slot, blocks)

    pool.checksums = checksums  # type: ignore[method-assign]
    return asked


def test_a_claim_does_not_read_again_what_the_proof_found_sound() -> None:
    pool, _ = adopted()
    assert pool.prove() == 3
    asked = counting(pool)
    claim = pool.claim([*TOKENS, 99], free=[0, 1, 2], prompt=0, chunk=16)
    assert (claim.slot, claim.start, claim.corrupt) == (1, 40, 0)
    assert asked == [[]]  # every block it reused was proven


def test_a_block_sealed_again_after_the_proof_is_read_by_its_claim() -> None:
    pool, _ = adopted()
    pool.prove()
    pool.claim(TOKENS[:40], free=[1], prompt=0, chunk=16)  # reuses 39: retires block 2
    more = [*TOKENS, 41, 42]
    pool.k[:, 1, :, 40:42] = 1.0
    pool.seal(1, more, 40, 42)  # block 2 now holds 10 positions: a new seal
    asked = counting(pool)
    claim = pool.claim([*more, 7], free=[1], prompt=0, chunk=16)
    assert claim.start == 42
    assert asked == [[(2, 10)]]


def test_a_block_corrupt_before_the_proof_is_found_by_its_claim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, _ = adopted()
    pool.k[1, 1, 0, 20] += 1.0  # block 1, under its seal
    assert pool.prove() == 2  # blocks 0 and 2
    with caplog.at_level(logging.WARNING, logger="understudy.engine_shim.kvpool"):
        claim = pool.claim([*TOKENS, 99], free=[1], prompt=0, chunk=16)
    assert (claim.start, claim.corrupt) == (16, 1)  # recomputed from block 1 on
    assert "event=kv_corrupt_block slot=1 block=1" in caplog.text


def test_warm_proves_on_its_own_thread_then_runs_the_engines_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, _ = adopted()
    ran: list[str] = []

    def then() -> int:
        ran.append("then")
        return 3 << 20

    with caplog.at_level(logging.INFO, logger="understudy.engine_shim.kvpool"):
        thread = pool.warm(then)
        thread.join(30)
    assert not thread.is_alive() and ran == ["then"]
    assert "event=kv_warmed proven=3 " in caplog.text and "then_mib=3 " in caplog.text
    asked = counting(pool)
    pool.claim([*TOKENS, 99], free=[1], prompt=0, chunk=16)
    assert asked == [[]]


def test_warm_proves_nothing_past_its_budget(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool, _ = adopted()
    monkeypatch.setattr(kvpool, "PROVE_MAX_BYTES", 1024)
    with caplog.at_level(logging.INFO, logger="understudy.engine_shim.kvpool"):
        pool.warm().join(30)
    assert "event=kv_warmed mib=0 " in caplog.text  # no proof, nothing else to do
    asked = counting(pool)
    claim = pool.claim([*TOKENS, 99], free=[1], prompt=0, chunk=16)
    assert claim.start == 40
    assert asked == [[(0, 16), (1, 16), (2, 8)]]  # the claim checks them itself
