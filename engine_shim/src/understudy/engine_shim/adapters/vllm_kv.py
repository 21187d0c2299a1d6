"""The KV cache of a CPU standby: its pages given back, its addresses kept.

vLLM allocates the KV cache when it builds its engine core (one buffer, a
view of it bound into every attention layer and the model runner) and never
again. On a GPU, sleep mode does what a standby needs: ``sleep(level=1)``
releases the cache's physical memory and keeps its virtual addresses (CUDA
VMM), ``wake_up()`` backs the same addresses with fresh memory, and every
tensor and binding stays valid. vLLM-CPU has no sleep mode; this module is
its stand-in, with the same effect through the kernel:

- ``release``: the cache's whole pages given back, one of two ways (the
  engine's ``--kv-release``):
  - ``reclaimable`` (``MADV_FREE``, the default): the kernel takes the
    pages when it needs memory, first of all (they are discarded, never
    swapped), and until then they stay where they are. They leave the
    working set at once (the cgroup counts them as inactive file memory:
    kubelet's working set, usage less inactive file, drops by the cache's
    size), and a page the kernel has not taken is there at wake with no
    fault. A failover at 4,000 tokens writes 180 MiB of vLLM's blocks at
    once: backing them took 25-110 ms with fresh pages on a machine whose
    hypervisor takes freed 2 MiB blocks back, under 3 ms with these, and
    the load into them 28-35 ms against 30-68 (docs/vllm.md).
  - ``now`` (``MADV_DONTNEED``): the kernel frees them at once (the
    process's RSS and PSS drop by the cache's size).

  Either way the mapping stays, and a page touched again reads as zeros
  (taken) or as what it held (not taken): vLLM writes every position before
  it reads it.
- at wake, nothing is needed for correctness: there is no restore (a page
  taken comes back, zeroed, on first touch: the kernel's own lazy
  allocation, as ``torch.empty`` or ``np.zeros`` get it). ``populate``
  commits the pages at once (``MADV_POPULATE_WRITE``), for a deployment that
  would rather pay for the whole cache at wake than a page fault per 4 KiB
  during the first requests (the engine's ``--kv-at-wake populate``).

What was cached is gone, so the caller must also forget it (vLLM's
``reset_prefix_cache``): a prefix hit on a released block would read zeros
or a stale block.

The functions taking a ``worker`` run through vLLM's ``collective_rpc``, in
whichever process holds the model runner (this one: the engine runs
in-process).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from understudy.engine_shim.memadvise import (
    HUGE,
    MADV_COLLAPSE,
    MADV_DONTNEED,
    MADV_FREE,
    MADV_HUGEPAGE,
    MADV_POPULATE_WRITE,
    advise,
    pages,
    try_advise,
)


def storages(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """The distinct buffers under ``tensors`` (views share one): (address, bytes)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[int(storage.data_ptr())] = int(storage.nbytes())
    return sorted(seen.items())


def _kv_tensors(worker: Any) -> list[Any]:
    caches = list(worker.model_runner.kv_caches)
    if not caches:
        raise RuntimeError("vLLM's model runner holds no KV cache")
    return caches


def ranges(worker: Any) -> list[tuple[int, int]]:
    """The KV cache's buffers: (address, bytes)."""
    return storages(_kv_tensors(worker))


def release(worker: Any, reclaimable: bool = False) -> int:
    """Give the KV cache's pages back to the kernel, at once or for it to take
    when it needs memory (``reclaimable``); the bytes released.

    Reclaimable pages are first backed again, zeroed, under the huge-page
    advice where ``huge`` gave it: vLLM zeroed its cache on 4 KiB pages
    before that advice, and the pages kept are the ones the next Active
    serves from. Memory the kernel cannot free lazily (not private anonymous
    memory) is freed at once."""
    total = 0
    for address, nbytes in storages(_kv_tensors(worker)):
        start, length = pages(address, nbytes)
        advise(start, length, MADV_DONTNEED)
        backed = reclaimable and try_advise(start, length, MADV_POPULATE_WRITE)
        if backed and not try_advise(start, length, MADV_FREE):
            advise(start, length, MADV_DONTNEED)
        total += length
    return total


def populate(worker: Any) -> int:
    """Commit the KV cache's pages now rather than on first touch; the bytes."""
    total = 0
    for address, nbytes in storages(_kv_tensors(worker)):
        start, length = pages(address, nbytes)
        advise(start, length, MADV_POPULATE_WRITE)
        total += length
    return total


def next_free_blocks(engine: Any, n: int) -> list[int]:
    """The ids of the ``n`` blocks that ``engine``'s (an in-process
    ``LLMEngine``) scheduler hands out next: the head of its free-block
    queue, from which a new request's blocks come in order. Read from
    vLLM's internals, so best effort: [] where they are not as in vLLM 0.32."""
    try:
        pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    except AttributeError:
        return []
    out: list[int] = []
    while block is not None and block is not tail and len(out) < n:
        out.append(int(block.block_id))
        block = getattr(block, "next_free_block", None)
    return out


def zeroes_new_blocks(engine: Any) -> bool:
    """Whether ``engine``'s worker zeroes the blocks its scheduler hands out
    before the step that uses them (vLLM does where its cache mixes
    precisions, or holds Mamba state): what is written into them ahead
    would be lost. True where vLLM's internals are not as in vLLM 0.32."""
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        return bool(scheduler.needs_kv_cache_zeroing)
    except AttributeError:
        return True


def block_spans(caches: Sequence[Any], block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """The memory of ``block_ids`` in every layer's cache (tensors whose first
    dimension is the block), (address, bytes): layer by layer, each run of
    consecutive ids as one span."""
    ids = sorted(set(block_ids))
    runs: list[tuple[int, int]] = []  # [first, last + 1)
    for b in ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    out = []
    for cache in caches:
        per = int(cache.stride(0)) * int(cache.element_size())
        base = int(cache.data_ptr())
        out += [(base + lo * per, (hi - lo) * per) for lo, hi in runs]
    return out


def huge(worker: Any) -> int:
    """Ask for transparent huge pages under the KV cache (what the kernel backs
    it with from now on, at each first touch); the bytes advised."""
    total = 0
    for address, nbytes in storages(_kv_tensors(worker)):
        start, length = pages(address, nbytes, HUGE)
        if try_advise(start, length, MADV_HUGEPAGE):
            total += length
    return total


# --- the whole process: huge pages, so that its death is quick ------------------


def anonymous_regions(maps: str, min_bytes: int = HUGE) -> list[tuple[int, int]]:
    """The private, writable, anonymous mappings in ``maps`` (the text of
    /proc/PID/maps) of at least ``min_bytes``: (start, end). These hold the
    process's heap, torch's tensors and vLLM's repacked weights; mapped
    files, shared memory (GMS) and reservations (no access) are not among
    them."""
    out = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        span, perms = fields[0], fields[1]
        name = fields[5] if len(fields) > 5 else ""
        if not perms.startswith("rw") or perms[3] != "p" or name not in ("", "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        if hi - lo >= min_bytes:
            out.append((lo, hi))
    return out


def collapse(exclude: Sequence[tuple[int, int]] = ()) -> int:
    """Back the process's large anonymous memory with transparent huge pages
    (``MADV_HUGEPAGE`` and ``MADV_COLLAPSE``), except the ``exclude`` ranges
    ((address, bytes)); the bytes collapsed.

    Why: the lock is the engine's connection, and the kernel closes a killed
    process's sockets only after it has torn down its memory. A process with
    1 GiB of touched 4 KiB pages took 1.1 s from SIGKILL to its socket's EOF
    on this machine (load average 23); with huge pages, 31-39 ms. The Active
    engine's memory is the next engine's wait for the lock."""
    with open("/proc/self/maps") as f:
        regions = anonymous_regions(f.read())
    total = 0
    for lo, hi in regions:
        for a, b in _minus(lo, hi, exclude):
            start, length = pages(a, b - a, HUGE)
            if not try_advise(start, length, MADV_HUGEPAGE):
                continue
            # One huge page at a time: where the kernel has no free huge page
            # for one, the others still collapse.
            total += sum(
                HUGE
                for at in range(start, start + length, HUGE)
                if try_advise(at, HUGE, MADV_COLLAPSE)
            )
    return total


def _minus(lo: int, hi: int, exclude: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` without the ``exclude`` ranges ((address, bytes))."""
    parts = [(lo, hi)]
    for address, nbytes in exclude:
        a, b = address, address + nbytes
        parts = [
            piece
            for p, q in parts
            for piece in ((p, min(q, a)), (max(p, b), q))
            if piece[0] < piece[1]
        ]
    return parts
