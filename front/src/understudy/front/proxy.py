"""The front door's asyncio shell: the pod's serving port, for the pod's whole life.

A :class:`Front` puts the parts together and runs their life: the routing
(``router``: the lock watch, the heartbeat check, the waits for a route),
the requests (``forwarder``: handle, attempt, relay, continue; served by the
front's own HTTP/1.1 server, ``downstream``), the probes and metrics on their
own port (``status``), the serving socket's hand-over and the drain.

The serving socket is not the front's own: the lock server keeps it and hands
it to each front that starts (``understudy.wire.handover``), so a front's
death refuses no connection; they wait in the kernel's queue until the next
front accepts them. A restarted front accepts first and imports the rest
after (the lock watch's protocol, the metrics' exposition): its start is
the clients' wait. What its death loses, the requests inside it, the next
front counts (``ledger``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from understudy.front import connlog, downstream, fsm
from understudy.front import status as status_port
from understudy.front.config import FrontConfig
from understudy.front.forwarder import Forwarder
from understudy.front.ledger import LEDGER, Ledger, Predecessor
from understudy.front.metrics import FrontMetrics
from understudy.front.router import Router
from understudy.wire import connhold, failpoints, handover, respawn, uds
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.front")

# Asking for the serving socket: while the keeper holds the port but does not
# answer yet (it is restarting too), ask again this often, this long.
_OBTAIN_RETRY_S = 0.05
_OBTAIN_FOR_S = 30.0


class Front:
    """The pod's front door: a router, a forwarder, and the port they serve."""

    def __init__(self, cfg: FrontConfig, metrics: FrontMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or FrontMetrics()
        self.router = Router(cfg, self.metrics)
        self.forwarder = Forwarder(
            self.router, fsm.Policy(cfg.hold_s, cfg.migration_limit), self.metrics
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._status: downstream.Server | None = None
        # The client connections outlive this front: the lock server keeps a
        # copy of each (``connhold``), and each one's record (``connlog``)
        # tells the next front how to finish it.
        self._holder: connhold.Holder | None = None
        self._conns = cfg.run_dir / connlog.DIR
        self._cid_prefix = f"{time.time_ns():x}"
        self._cid_next = 0
        self._adopting: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._ledger: Ledger | None = None
        self._server = downstream.Server(
            self.forwarder.handle,
            downstream.Limits(max_body=cfg.max_body, idle_s=cfg.idle_s),
            self.forwarder.refused,
            self._on_busy,
        )
        # Read when scraped, not set on every request.
        self.metrics.inflight.set_function(lambda: self.forwarder.inflight)
        self.metrics.held.set_function(lambda: self.router.held)

    def _on_busy(self, n: int, idle: int) -> None:
        if self._ledger is not None:
            self._ledger.busy(n, idle)

    # ------------------------------------------------------------ surface --

    def pressure(self) -> dict[str, Any]:
        return {
            "inflight": self.forwarder.inflight,
            "held": self.router.held,
            "active": self.router.route is not None,
        }

    def view(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),  # the front's own process (under the respawner)
            **self.router.view(),
            **self.pressure(),
            "at_engine": self.forwarder.at_engine,
            # poison isolation: "open" unless a suspect waits for its turn
            # alone (a drill's next round waits for it: docs/poison.md)
            "isolation": self.forwarder.isolation.state.phase.value,
        }

    def ready(self) -> tuple[bool, str]:
        return self.router.ready()

    # --------------------------------------------------------------- life --

    async def start(self, listener: socket.socket, offer: handover.Offer | None = None) -> None:
        """Accept on ``listener`` at once, then start everything else."""
        if offer is not None and offer.holder is not None:
            # The keeper's word on the lock until the watch's (the same word).
            self.router.feed(fsm.HolderSeen(offer.holder, offer.epoch))
        self._listener = listener
        adopted = self._hold_connections()
        self._ledger = Ledger(self.cfg.run_dir / LEDGER)
        before = self._ledger.take_over(len(adopted))
        self._server.serve_on(listener, handover.BACKLOG)
        self._took_over(before)
        for cid, owned in adopted:
            task = asyncio.create_task(self._adopt(cid, owned), name="adopt")
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)
        # Under the respawner the status port is its socket, open across our
        # restarts (render.py says why); alone, we bind it.
        self._status = await status_port.serve(
            self, self.cfg.host, self.cfg.status_port, respawn.inherited_socket("status")
        )
        self.router.start()
        self._tasks = [
            asyncio.create_task(
                handover.offer_forever(
                    self.cfg.run_dir / handover.FRONT_SOCKET,
                    lambda: self._listener,
                    self._offer,
                    log,
                ),
                name="handover",
            ),
        ]
        log_event(
            log, "listening", port=self.cfg.port, status_port=self.cfg.status_port,
            hold_s=self.cfg.hold_s, migration_limit=self.cfg.migration_limit,
        )  # fmt: skip

    # -------------------------------------------- connections that outlive it --

    def _hold_connections(self) -> list[tuple[str, uds.OwnedFd]]:
        """Connect to the connections' keeper and take what it kept of a
        front that died; from now on every accepted connection is kept."""
        self._conns.mkdir(mode=0o700, exist_ok=True)
        holder = connhold.Holder(self.cfg.run_dir / connhold.CONNS_SOCKET, log)
        adopted: list[tuple[str, uds.OwnedFd]] = []
        if holder.connect():
            try:
                adopted = holder.adopt()
                holder.watch()
            except (OSError, connhold.HoldError) as exc:
                # What the dead front had is lost; from now on, all is kept.
                log_event(log, "adopt_failed", logging.ERROR, error=str(exc))
                holder.close()
        if not holder.connected:
            log_event(
                log, "connections_unkept", logging.WARNING,
                consequence="until the lock server keeps them, this front's death closes "
                "its clients' connections",
            )  # fmt: skip
            holder.keep_trying()
        self._holder = holder
        holder.live = self._server.live
        self._server.keep = self._keep
        self._server.on_closed = self._closed
        self._server.resume = self.forwarder.resume
        names = {p.name for p in self._conns.iterdir()}
        others = names - {cid for cid, _ in adopted}
        others -= self._find_records(adopted, names, others)
        for stale in others:  # records of connections nobody kept
            with contextlib.suppress(OSError):
                (self._conns / stale).unlink()
        return adopted

    def _find_records(
        self, adopted: list[tuple[str, uds.OwnedFd]], names: set[str], others: set[str]
    ) -> set[str]:
        """Name each kept connection's record by the id the keeper holds it
        under, of the records ``names`` (``others``: no kept connection's);
        the names renamed. A front killed while its copy of a connection
        waited to be sent (a keeper slow to read) had written the
        connection's record under its own id, and its witness held the
        connection under another: the record says which socket it is of."""
        unnamed = [(cid, owned) for cid, owned in adopted if cid not in names]
        if not unnamed or not others:
            return set()
        by_inode = connlog.inodes(self._conns, others)
        renamed: set[str] = set()
        for cid, owned in unnamed:
            name = by_inode.pop(os.fstat(owned.fd).st_ino, None)
            if name is None:
                continue
            try:
                (self._conns / name).rename(self._conns / cid)
            except OSError as exc:
                log_event(log, "record_unnamed", logging.WARNING, id=cid, error=str(exc))
                continue
            renamed.add(name)
            log_event(log, "record_found", id=cid, record=name)
        return renamed

    def _keep(self, conn: socket.socket) -> connlog.ConnLog | None:
        """A connection just accepted: a copy to the keeper, then its record.

        The copy first: until the keeper has one, the connection is in this
        process's descriptor table alone (shared with the front's witness,
        which gives it to the keeper if this process dies first: ``witness``).
        The record is a file created (30-50 us here, up to a millisecond);
        the copy is one ``sendmsg``. A front that dies before the record
        leaves a held connection with no record, which the next one serves
        from its first byte (nothing was read)."""
        assert self._holder is not None
        self._cid_next += 1
        cid = f"{self._cid_prefix}-{self._cid_next}"
        failpoints.hit("front.accept.copy")
        self._holder.hold(cid, conn.fileno())
        failpoints.hit("front.accept.record")
        try:
            return connlog.ConnLog.create(self._conns, cid, os.fstat(conn.fileno()).st_ino)
        except OSError as exc:  # a full volume: served, but not kept
            log_event(log, "connlog_failed", logging.ERROR, error=str(exc))
            self._holder.drop(cid)
            return None

    def _closed(self, record: connlog.ConnLog) -> None:
        if self._holder is not None:
            self._holder.drop(record.cid)
        record.remove()

    async def _adopt(self, cid: str, owned: uds.OwnedFd) -> None:
        """Finish what the front that died left on one connection."""
        sock = socket.socket(fileno=owned.detach())
        try:
            inode, found = os.fstat(sock.fileno()).st_ino, True
            try:
                record, tx_base, records = connlog.ConnLog.reopen(self._conns, cid, inode)
            except FileNotFoundError:  # accepted, nothing read yet
                record, tx_base, records = connlog.ConnLog.create(self._conns, cid, inode), 0, []
                found = False
            plan = connlog.plan(
                tx_base, records, connlog.kernel_count(sock),
                rx_base=record.rx_base, read=connlog.kernel_read(sock), found=found,
            )  # fmt: skip
            if plan.rebase is not None:  # its front died compacting it
                record.rebase(*plan.rebase)
        except (OSError, connlog.LogError) as exc:
            # Nothing to finish it from: its client sees the close.
            log_event(log, "adopt_connection_failed", logging.ERROR, id=cid, error=str(exc))
            sock.close()
            if self._holder is not None:
                self._holder.drop(cid)
            return
        self.metrics.adopted.inc()
        log_event(
            log, "adopted", id=cid, done=plan.done, tail=len(plan.tail), replay=len(plan.rx),
            skip=plan.skip, stream_tokens=len(plan.stream.token_ids) if plan.stream else None,
            rebased=plan.rebase is not None, peer=_peer(sock),
        )  # fmt: skip
        self._server.adopt(sock, record, plan)

    def _took_over(self, before: Predecessor) -> None:
        """Count what the previous front lost, and say it."""
        assert self._ledger is not None
        m = self.metrics
        m.lost.inc(self._ledger.lost)
        m.idle_lost.inc(self._ledger.idle_lost)
        m.restarts.inc(self._ledger.starts - 1)
        if before.pid:
            log_event(
                log, "took_over", logging.WARNING if before.busy else logging.INFO,
                predecessor=before.pid, lost=before.busy if not before.torn else "unknown",
                idle_closed=before.idle if not before.torn else "unknown",
                lost_total=self._ledger.lost, restarts=self._ledger.starts - 1,
            )  # fmt: skip

    def _offer(self) -> handover.Offer:
        route = self.router.route
        return handover.Offer(
            port=self.cfg.port,
            keeper="front",
            pid=os.getpid(),
            holder=route.engine_id if route else None,
            epoch=route.epoch if route else 0,
        )

    async def drain(self) -> None:
        """Stop accepting (new connections wait for the next front), finish
        in-flight requests (bounded), then close."""
        self._server.stop_accepting()
        await self.forwarder.settle(self.cfg.drain_s)
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.router.close()
        live = self._server.live()
        self._server.close()
        if self._holder is not None:
            # Closed for good: the keeper's copies go too (the clients see the close now).
            for cid, _ in live:
                self._holder.drop(cid)
            self._holder.close()
        if self._status is not None:
            self._status.close()
        if self._ledger is not None:
            # what a drain could not finish
            self._ledger.busy(self._server.busy, self._server.idle)
            self._ledger.close()


async def obtain(cfg: FrontConfig) -> tuple[socket.socket, handover.Offer | None, str]:
    """The pod's serving socket: from the lock server that keeps it, else
    bound here (nobody keeps it: the front's death will refuse connections)."""
    keeper = [cfg.run_dir / handover.KEEPER_SOCKET]
    deadline = time.monotonic() + _OBTAIN_FOR_S
    while True:
        try:
            return handover.obtain(keeper, cfg.host, cfg.port)
        except OSError as exc:
            # Taken, but nobody offers it: the keeper restarts too. Ask again.
            if not handover.in_use(exc) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(_OBTAIN_RETRY_S)


async def run(cfg: FrontConfig, started: float | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain. ``started``: seconds since this
    process's exec when it was called (its start time is reported)."""
    t0 = time.monotonic()
    listener, offer, source = await obtain(cfg)
    front = Front(cfg)
    await front.start(listener, offer)
    seconds = (started or 0.0) + time.monotonic() - t0
    front.metrics.start_seconds.set(seconds)
    log_event(
        log, "accepting", source=source, start_ms=round(seconds * 1000, 1),
        cpu_ms=round(time.process_time() * 1000, 1),  # of that start: the machine's load aside
    )  # fmt: skip
    if source == "bound":
        log_event(
            log, "serving_socket_unkept", logging.WARNING, keeper=str(cfg.run_dir),
            consequence="nobody keeps the serving socket: this front's death refuses connections",
        )  # fmt: skip
    respawn.notify_ready()
    await downstream.until_stopped()
    log_event(log, "draining", inflight=front.forwarder.inflight, held=front.router.held)
    await front.drain()


def _peer(sock: socket.socket) -> str:
    """The client's address (a drill's failure names its port), or why not."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError as exc:  # the client is gone already
        return exc.strerror or type(exc).__name__
    return f"{host}:{port}"
