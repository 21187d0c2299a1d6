"""What the respawner and the process it runs say to each other: the child's
side of ``understudy respawn`` (the respawner itself is ``understudy.respawner``).

Every process of the pod runs under the respawner, and each speaks this
small contract with it, after systemd's sd_notify and socket activation:

- ``UNDERSTUDY_NOTIFY_FD``: the write end of a pipe on which the child says
  it started, ``READY=1`` (:func:`notify_ready`, once, when the process has
  proved it can start: an engine in Standby, a front that listens);
- ``UNDERSTUDY_RESTARTS``: how many children came before this one
  (:func:`restarts`);
- ``UNDERSTUDY_LISTEN_FDS``: ``NAME=FD,…``, listening sockets the respawner
  bound once and every child inherits (:func:`inherited_socket`);
- ``UNDERSTUDY_SPARE_GO_FD``: in a spare (a process started ahead of time),
  the read end of a pipe on which the respawner writes ``GO <restarts>``
  when the spare's turn comes (:func:`is_spare`, :func:`wait_turn`).

It lives in ``wire`` because it is what two processes speak, and every
component's process imports it; the respawner writes its side with the
names and formats defined here.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

NOTIFY_FD = "UNDERSTUDY_NOTIFY_FD"
RESTARTS = "UNDERSTUDY_RESTARTS"
GO_FD = "UNDERSTUDY_SPARE_GO_FD"
# "1": a spare also runs its adapter's deferred imports (``spare_imports``:
# vLLM's, seconds of CPU) before its turn, at a lower priority. Only where
# nice can make them yield, inside one autogroup: the local runner sets it.
# In a Kubernetes pod each container is a cgroup that nice does not cross,
# and the spare's imports took the Active engine's CPU at the standby's
# weight (docs/pod.md).
SPARE_IMPORTS = "UNDERSTUDY_SPARE_IMPORTS"
LISTEN_FDS = "UNDERSTUDY_LISTEN_FDS"
READY = b"READY=1\n"
GO = "GO"


def go_line(restarts: int) -> bytes:
    """What the respawner writes to a spare whose turn has come."""
    return f"{GO} {restarts}\n".encode()


def listen_fds(named: Iterable[tuple[str, int]]) -> str:
    """``UNDERSTUDY_LISTEN_FDS``'s value for (name, fd) pairs."""
    return ",".join(f"{name}={fd}" for name, fd in named)


def notify_ready() -> bool:
    """Tell the respawner (if any) that this process started: call it once,
    when the process has proved it can start (an engine in Standby, a front
    that listens). Returns whether there was a respawner to tell."""
    fd = os.environ.pop(NOTIFY_FD, None)
    if not fd:
        return False
    try:
        os.write(int(fd), READY)
    except (OSError, ValueError):
        return False
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.close(int(fd))
    return True


def inherited_socket(name: str) -> socket.socket | None:
    """The listening socket the respawner passed as ``name`` (``--listen``), if
    any. The fd stays this process's (and its children's, until exec)."""
    for item in filter(None, os.environ.get(LISTEN_FDS, "").split(",")):  # see listen_fds
        key, _, fd = item.partition("=")
        if key == name and fd.isdigit():
            try:
                return socket.socket(fileno=int(fd))
            except OSError:
                return None
    return None


def restarts() -> int:
    """How many processes the respawner started before this one (0 without one)."""
    try:
        return int(os.environ.get(RESTARTS, "0"))
    except ValueError:
        return 0


def is_spare() -> bool:
    """Whether this process was started as a spare (and has not had its turn)."""
    return GO_FD in os.environ


def wait_turn() -> None:
    """In a spare, once prepared: block until the respawner says go, then
    return (the process is the child from now on). A no-op in any other
    process. A spare whose respawner is gone exits."""
    fd = os.environ.pop(GO_FD, None)
    if fd is None:
        return
    line = b""
    with contextlib.suppress(OSError):
        while not line.endswith(b"\n"):
            chunk = os.read(int(fd), 64)
            if not chunk:
                break
            line += chunk
    with contextlib.suppress(OSError):
        os.close(int(fd))
    word, _, number = line.decode(errors="replace").strip().partition(" ")
    if word != GO:
        os._exit(0)  # the respawner ended: a spare has nothing to finish
    os.environ[RESTARTS] = number if number.isdigit() else "0"
