"""The synthetic engine over one GMS server, in its own process (so that the
test process never loads a CUDA driver, or the double). Prints one JSON line.

    python synthetic_client.py load  SOCKET MODEL [ENGINE ARGS...]
        RW: the engine's ``load`` (Allocation.write), commit, then a write
        after commit (refused); the session ends, the layout stays committed.
    python synthetic_client.py check SOCKET MODEL [ENGINE ARGS...]
        RO: import, ``checksum`` (Allocation.read) sampled, and full from
        the engine's checksum thread; asleep (unmapped) a checksum is
        refused; awake again, the same checksum.
"""

from __future__ import annotations

import json
import sys

from understudy.engine_shim.adapters.synthetic import SyntheticEngine
from understudy.gms.client import GmsClient
from understudy.gms.messages import GmsError, Mode


def load(engine: SyntheticEngine, path: str) -> dict[str, object]:
    with GmsClient.connect(path, Mode.RW, timeout=30) as session:
        engine.load(0, session)
        digest = session.commit()
        try:
            session.allocations[0].write(b"x")
            refused = ""
        except GmsError as exc:
            refused = str(exc)
        return {"backend": session.backend, "layout_hash": digest, "write_refused": refused}


def check(engine: SyntheticEngine, path: str) -> dict[str, object]:
    with GmsClient.connect(path, Mode.RO, timeout=30) as session:
        session.import_all()
        engine.attach({0: session})
        engine.wake()
        out: dict[str, object] = {
            "backend": session.backend,
            "sizes": [a.size for a in session.allocations],
            "sample": engine.checksum(full=False),
            # From the engine's checksum thread, as its HTTP route asks: on
            # cuda a thread with no current context (the mapper makes one).
            "full": engine._pool.submit(engine.checksum, True).result(timeout=60),
        }
        session.unmap()
        try:
            engine.checksum(full=False)
            out["asleep"] = ""
        except GmsError as exc:
            out["asleep"] = str(exc)
        session.remap(timeout=30)
        out["sample_after_wake"] = engine.checksum(full=False)
        return out


def main() -> None:
    op, path, model, *args = sys.argv[1:]
    engine = SyntheticEngine(model, tuple(args), (0,))
    try:
        doc = load(engine, path) if op == "load" else check(engine, path)
    finally:
        engine.close()
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
