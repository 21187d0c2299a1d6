"""Many GMS servers (the real ``GmsServer``) in one process and one event loop.

For tests that need fresh GMS state many times over (100 start orders): one
server per (trial, device), socket ``<root>/t<trial>/gms_<device>_weights.sock``.
Usage: python multiserver.py ROOT TRIALS DEVICES — prints {"ready": true}.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from understudy.gms.config import ServerConfig, socket_path
from understudy.gms.server import GmsServer


async def main(root: Path, trials: int, devices: int) -> None:
    servers = []
    for t in range(trials):
        for d in range(devices):
            cfg = ServerConfig(socket=socket_path(root / f"t{t}", d), device=d)
            server = GmsServer(cfg)
            await server.start()
            servers.append(server)
    print(json.dumps({"ready": True}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for server in servers:
        await server.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
