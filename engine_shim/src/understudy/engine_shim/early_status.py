"""The status port from the first moments of the engine's life, before the shim.

An engine restarted in place by its container's respawner (docs/pod.md) is
under kubelet's liveness probe from its first instant: the startup probe ran
once, when the container started. The shim's own status server comes up
only after the engine's imports (aiohttp, numpy, pydantic, the adapter:
seconds on a busy node, a minute for vLLM), and a port that refuses for
three probe periods gets the container killed, which hands it to kubelet's
CrashLoopBackOff: the very thing the respawner is there to avoid.

So ``understudy engine run`` binds the status port first, with the standard
library only, and answers it from a small thread until the shim takes the
same listening socket over (:meth:`EarlyStatus.handover`): no refused
connection, no gap. Until then the engine is, truthfully, in Init:

- ``/live`` 200 ("starting"), the startup budget holding as it does in Init
  (503 past it: a process that cannot even import is hung);
- ``/startup`` and ``/ready`` 503;
- ``/state`` the little that is known (state Init, pid, role, name, restarts);
- anything else 503 (``/metrics`` included: nothing is counted yet).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time

from understudy.wire import respawn

_READ_LIMIT = 8192


class EarlyStatus:
    def __init__(self, sock: socket.socket, budget_s: float) -> None:
        self.sock = sock
        self._budget_s = budget_s
        self._started = time.monotonic()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="early-status", daemon=True)

    @classmethod
    def start(cls, port: int, host: str = "0.0.0.0", budget_s: float = 600.0) -> EarlyStatus:
        """Answer on the status socket the container's respawner holds
        (``--listen status=…``: it stays open across restarts), else bind and
        listen on ``port`` (OSError if it cannot); answer from now on."""
        sock = respawn.inherited_socket("status")
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(128)
            except BaseException:
                sock.close()
                raise
        early = cls(sock, budget_s)
        early._thread.start()
        return early

    @property
    def port(self) -> int:
        port: int = self.sock.getsockname()[1]
        return port

    def handover(self) -> socket.socket:
        """Stop answering and give the listening socket to the shim's server;
        connections not yet accepted wait in its backlog meanwhile."""
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._thread.join(5)
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.sock.setblocking(False)
        return self.sock

    # --- the thread -----------------------------------------------------------

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.sock.fileno(), self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        try:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < _READ_LIMIT:
                chunk = conn.recv(_READ_LIMIT)
                if not chunk:
                    return
                head += chunk
            status, body, kind = self.answer(head.split(b"\r\n", 1)[0])
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            conn.sendall(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
        except OSError:
            return

    def answer(self, request_line: bytes) -> tuple[int, bytes, str]:
        """(status, body, content type) for one request line."""
        parts = request_line.split()
        path = parts[1].decode(errors="replace").split("?")[0] if len(parts) >= 2 else ""
        age = time.monotonic() - self._started
        text = "text/plain; charset=utf-8"
        if path == "/live":
            if age > self._budget_s:
                return 503, f"starting for {age:.1f}s > {self._budget_s:g}s\n".encode(), text
            return 200, f"starting for {age:.1f}s\n".encode(), text
        if path == "/state":
            doc = {
                "state": "Init",
                "phase": "starting",
                "pid": os.getpid(),
                "role": os.environ.get("ENGINE_ROLE"),
                "name": os.environ.get("UNDERSTUDY_ENGINE_NAME"),
                "restarts": respawn.restarts(),
                "time_in_state_s": round(age, 4),
            }
            return 200, json.dumps(doc).encode(), "application/json"
        if path in ("/startup", "/ready", "/metrics"):
            return 503, f"starting for {age:.1f}s\n".encode(), text
        return 404, b"not found\n", text
