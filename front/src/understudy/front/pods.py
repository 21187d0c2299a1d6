"""The fleet gateway's decision core: which pod a request goes to, and
whether a pod is dead (pure, time passed in).

The gateway routes to the pods' own fronts. Each pod is a small machine
(``step``, one ``TRANSITIONS`` table), fed by the gateway's shell
(``gateway``):

- its front's ``/ready``, probed every ``check_s`` (``Probed``): ready pods
  take requests; a pod that answers "not ready" takes none, but its front
  still holds and finishes what it has, so nothing moves;
- an attempt that was refused or whose connection reset (``Broke``), or an
  open stream that fell silent (the pod's front heartbeats every stream a
  gateway reads, ``wire.serving.BEAT_EVENT``);
- no probe answered past the deadline (``Silent``: a frozen or partitioned
  node; judged by ``fsm.judge_beat``, so a check that ran late because the
  gateway itself was not scheduled judges nothing).

A dead pod's connections are aborted (``Dead``), so each request in it moves
to another pod through the forwarder's migration, token-exact. Only an
answer to a probe sent after its death brings it back, under a new
generation (the route's epoch): an attempt begun under the old one finds its
connections given up on. A pod that leaves the list (``listed``) is dead too.

A pod listed as terminating (a rollout, a drain, a scale-down: its
EndpointSlice condition) is LEAVING: it takes nothing new, its requests
finish there, and those still there when its grace ends (``Overdue``) move,
as its death would move them, before the kubelet kills it. Dead then, it
stays dead while it is listed so, whatever its front still answers.

Which pod: the ready one with the fewest requests in flight (``pick``), ties
taken in turn.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, assert_never
from urllib.parse import parse_qs, urlsplit

from understudy.front.fsm import Beat, Watchdog, judge_beat
from understudy.wire import machine
from understudy.wire.serving import SERVING_PORT_NAME, STATUS_PORT_NAME

# ----------------------------------------------------------------- pods ----


class PodListError(ValueError):
    """A pod's address, or a pods file, that cannot be read."""


@dataclass(frozen=True, slots=True)
class Listing:
    """A pod as its endpoint list names it."""

    name: str
    host: str
    port: int  # its front's serving port
    status_port: int  # its front's status port (/ready)
    terminating: bool = False  # on its way out (planned): takes nothing new

    @property
    def address(self) -> tuple[str, int, int]:
        """What makes it the same pod: a listing that only became terminating is."""
        return (self.host, self.port, self.status_port)


def parse_pod(text: str, default_status_port: int = 8090) -> Listing:
    """``http://HOST:PORT[?status=PORT][&name=NAME]`` (or ``HOST:PORT``)."""
    url = urlsplit(text if "//" in text else f"http://{text}")
    if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
        raise PodListError(f"{text!r}: a pod is http://HOST:PORT[?status=PORT][&name=NAME]")
    try:
        port = url.port
        query = {k: v[-1] for k, v in parse_qs(url.query, strict_parsing=bool(url.query)).items()}
        status = int(query.pop("status", default_status_port))
    except ValueError as exc:
        raise PodListError(f"{text!r}: {exc}") from None
    name = query.pop("name", f"{url.hostname}:{port}")
    if port is None or query or not 0 < status < 65536:
        raise PodListError(f"{text!r}: a port, and only status= and name= after '?'")
    return Listing(name, url.hostname, port, status)


def _entry(item: Any, default_status_port: int) -> Listing:
    """An address (``parse_pod``), or ``{"address": ..., "terminating": bool}``."""
    if isinstance(item, str):
        return parse_pod(item, default_status_port)
    if (
        isinstance(item, dict)
        and isinstance(item.get("address"), str)
        and isinstance(item.get("terminating", False), bool)
        and set(item) <= {"address", "terminating"}
    ):
        li = parse_pod(item["address"], default_status_port)
        return replace(li, terminating=item.get("terminating", False))
    raise PodListError(
        "a pods file is a JSON list of addresses (http://HOST:PORT?status=PORT) "
        'or {"address": ..., "terminating": true|false}'
    )


def parse_pods_file(text: str, default_status_port: int = 8090) -> list[Listing]:
    """A pods file: a JSON list of pod addresses (``parse_pod``), each maybe
    with whether it is terminating."""
    try:
        doc: Any = json.loads(text)
    except ValueError as exc:
        raise PodListError(f"not JSON: {exc}") from None
    if not isinstance(doc, list):
        raise PodListError("a pods file is a JSON list")
    pods = [_entry(p, default_status_port) for p in doc]
    if len({p.name for p in pods}) != len(pods):
        raise PodListError("two pods of the same name")
    return pods


@dataclass(frozen=True, slots=True)
class Skipped:
    """An endpoint that gives no pod to route to, and why."""

    endpoint: str  # its pod's name, else its address, else the slice's name
    reason: str


def _named_ports(sl: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in sl.get("ports") or ():
        name, port = p.get("name"), p.get("port")
        if isinstance(name, str) and isinstance(port, int) and 0 < port < 65536:
            out[name] = port
    return out


def listings_from_slices(
    slices: Sequence[Mapping[str, Any]],
    port_name: str = SERVING_PORT_NAME,
    status_port_name: str = STATUS_PORT_NAME,
) -> tuple[list[Listing], list[Skipped]]:
    """The pods a Service's EndpointSlices (``discovery.k8s.io/v1``, plain
    dicts as the API returns them) list: one :class:`Listing` per endpoint
    address, named by the pod it targets, at the slice's ports named
    ``port_name`` (the front's serving port) and ``status_port_name`` (its
    ``/ready``), terminating as its ``conditions.terminating`` says. Its
    ``ready`` is not read: the pods' Service publishes not-ready addresses,
    and the gateway probes each front itself. An endpoint without an address,
    in a slice without those ports, or naming a pod listed already, is
    skipped with the reason."""
    listings: list[Listing] = []
    skipped: list[Skipped] = []
    seen: set[str] = set()
    for sl in sorted(slices, key=lambda s: str((s.get("metadata") or {}).get("name", ""))):
        ports = _named_ports(sl)
        port, status = ports.get(port_name), ports.get(status_port_name)
        for ep in sl.get("endpoints") or ():
            ref = ep.get("targetRef") or {}
            addresses = [a for a in ep.get("addresses") or () if isinstance(a, str) and a]
            pod = ref.get("name") if isinstance(ref.get("name"), str) else None
            label = pod or (addresses[0] if addresses else None)
            label = label or str((sl.get("metadata") or {}).get("name", "?"))
            if not addresses:
                skipped.append(Skipped(label, "no address"))
                continue
            if port is None or status is None:
                missing = port_name if port is None else status_port_name
                skipped.append(Skipped(label, f"its slice has no port named {missing!r}"))
                continue
            terminating = (ep.get("conditions") or {}).get("terminating") is True
            for i, host in enumerate(addresses):
                # A pod with several addresses (dual stack) is one pod per address.
                name = (pod if i == 0 else f"{pod}#{i}") if pod else f"{host}:{port}"
                if name in seen:
                    skipped.append(Skipped(name, "listed twice"))
                    continue
                seen.add(name)
                listings.append(Listing(name, host, port, status, terminating))
    return listings, skipped


class Phase(enum.Enum):
    NEW = "new"  # listed, not heard from yet: no requests
    READY = "ready"  # its front can serve: takes requests
    UNREADY = "unready"  # its front answers, and cannot serve: no new requests
    # terminating: nothing new; its requests finish there until leave_by
    LEAVING = "leaving"
    DEAD = "dead"  # refused, reset or silent: its requests moved, none go there


@dataclass(frozen=True, slots=True)
class Pod:
    listing: Listing
    phase: Phase = Phase.NEW
    generation: int = 1  # rises at each revival: the route's epoch
    heard_at: float | None = None  # the last probe it answered (loop time)
    dead_at: float | None = None
    reason: str = ""  # why it died
    leave_by: float | None = None  # LEAVING: when what it still has must move

    @property
    def name(self) -> str:
        return self.listing.name


# --------------------------------------------------------------- events ----


@dataclass(frozen=True, slots=True)
class Probed:
    """Its front answered ``/ready`` (``ready``: 200) to a probe sent at ``sent_at``."""

    name: str
    ready: bool
    sent_at: float


@dataclass(frozen=True, slots=True)
class Broke:
    """An attempt there was refused or reset, or a stream from it fell silent."""

    name: str
    reason: str  # "refused" | "reset" | "silent"


@dataclass(frozen=True, slots=True)
class Silent:
    """No probe answered for ``silent_s``."""

    name: str
    silent_s: float


@dataclass(frozen=True, slots=True)
class Terminating:
    """It is listed as terminating: what it has must be done by ``until``."""

    name: str
    until: float


@dataclass(frozen=True, slots=True)
class Overdue:
    """A LEAVING pod's grace is over: what it still has moves."""

    name: str


Event = Probed | Broke | Silent | Terminating | Overdue

# -------------------------------------------------------------- actions ----


@dataclass(frozen=True, slots=True)
class Routed:
    """It takes requests (again): wake the requests that wait for a pod."""

    name: str
    generation: int


@dataclass(frozen=True, slots=True)
class Unrouted:
    """It takes no new requests; its front finishes what it has."""

    name: str


@dataclass(frozen=True, slots=True)
class Dead:
    """Give up on it: abort its connections, so that its requests move."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Leaving:
    """It takes nothing new; what it has finishes there until ``until``."""

    name: str
    until: float


Action = Routed | Unrouted | Leaving | Dead


class InvalidTransition(machine.InvalidTransition):
    """An event the pod's phase does not accept (a bug in the shell)."""


class Kind(enum.Enum):
    """What an event means for the pod (:func:`kind`), the table's second key."""

    READY = "Probed (ready)"
    UNREADY = "Probed (not ready)"
    BEFORE_DEATH = "Probed (sent before it died)"  # says nothing of it now
    # Dead and listed as terminating (its grace ended, or it died leaving):
    # answering does not bring it back, or it would take new requests again.
    GONE = "Probed (dead, and on its way out)"
    BROKE = "Broke"
    SILENT = "Silent"
    TERMINATING = "Terminating"
    OVERDUE = "Overdue"


def kind(p: Pod, e: Event) -> Kind:
    match e:
        case Probed(ready=ready, sent_at=sent_at):
            if p.dead_at is not None and sent_at <= p.dead_at:
                return Kind.BEFORE_DEATH
            if p.dead_at is not None and p.listing.terminating:
                return Kind.GONE
            return Kind.READY if ready else Kind.UNREADY
        case Broke():
            return Kind.BROKE
        case Silent():
            return Kind.SILENT
        case Terminating():
            return Kind.TERMINATING
        case Overdue():
            return Kind.OVERDUE
        case _:
            assert_never(e)


# ------------------------------------------------------------- handlers ----

Result = tuple[Pod, list[Action]]


def _ready(p: Pod, e: Probed, now: float) -> Result:
    new = replace(p, phase=Phase.READY, heard_at=now)
    return new, [] if p.phase is Phase.READY else [Routed(p.name, p.generation)]


def _unready(p: Pod, e: Probed, now: float) -> Result:
    new = replace(p, phase=Phase.UNREADY, heard_at=now)
    return new, [Unrouted(p.name)] if p.phase is Phase.READY else []


def _revived(p: Pod, e: Probed, now: float) -> Result:
    """Dead, and answering again (restarted, or a partition healed): a new
    generation, so that nothing of the old one's is taken for it."""
    p = replace(p, generation=p.generation + 1, dead_at=None, reason="")
    return _ready(p, e, now) if e.ready else _unready(p, e, now)


def _died(p: Pod, e: Broke | Silent | Overdue, now: float) -> Result:
    match e:
        case Broke(reason=reason):
            pass
        case Silent():
            reason = "silent"
        case Overdue():
            reason = "removed"
    return replace(p, phase=Phase.DEAD, dead_at=now, reason=reason), [Dead(p.name, reason)]


def _leaving(p: Pod, e: Terminating, now: float) -> Result:
    return replace(p, phase=Phase.LEAVING, leave_by=e.until), [Leaving(p.name, e.until)]


def _heard(p: Pod, e: Probed, now: float) -> Result:
    """A LEAVING pod answers its probes: alive (not silent), and still leaving."""
    return replace(p, heard_at=now), []


def _ignore(p: Pod, e: Event, now: float) -> Result:
    return p, []


N, R, U, L, D = Phase.NEW, Phase.READY, Phase.UNREADY, Phase.LEAVING, Phase.DEAD
K = Kind
Entry = machine.Entry[Pod, Action, Phase]


def _to(handler: Callable[[Pod, Any, float], Result], *phases: Phase) -> Entry:
    return machine.Entry(handler, frozenset(phases))


# (phase, kind) -> (handler, the phases it may lead to). A dead pod comes back
# only by answering a probe sent after its death, and not while it is listed
# as terminating; a pod never heard from is not silent (it never spoke), only
# unknown.
TRANSITIONS: dict[tuple[Phase, Kind], Entry] = {
    (N, K.READY): _to(_ready, R),
    (N, K.UNREADY): _to(_unready, U),
    (N, K.BROKE): _to(_died, D),
    (R, K.READY): _to(_ready, R),
    (R, K.UNREADY): _to(_unready, U),
    (R, K.BROKE): _to(_died, D),
    (R, K.SILENT): _to(_died, D),
    (U, K.READY): _to(_ready, R),
    (U, K.UNREADY): _to(_unready, U),
    (U, K.BROKE): _to(_died, D),
    (U, K.SILENT): _to(_died, D),
    (N, K.TERMINATING): _to(_leaving, L),
    (R, K.TERMINATING): _to(_leaving, L),
    (U, K.TERMINATING): _to(_leaving, L),
    (L, K.READY): _to(_heard, L),
    (L, K.UNREADY): _to(_heard, L),
    (L, K.TERMINATING): _to(_ignore, L),
    (L, K.BROKE): _to(_died, D),
    (L, K.SILENT): _to(_died, D),
    (L, K.OVERDUE): _to(_died, D),
    (D, K.TERMINATING): _to(_ignore, D),  # gone already: nothing of it to finish
    (D, K.OVERDUE): _to(_ignore, D),
    (D, K.READY): _to(_revived, R),
    (D, K.UNREADY): _to(_revived, U),
    (D, K.BEFORE_DEATH): _to(_ignore, D),
    (D, K.GONE): _to(_ignore, D),
    (D, K.BROKE): _to(_ignore, D),
    (D, K.SILENT): _to(_ignore, D),
}


def _phase(p: Pod, e: object) -> Phase:
    return p.phase


def step(p: Pod, event: Event, now: float) -> Result:
    """Apply one event to one pod. Raises InvalidTransition (pod unchanged) on a miss."""
    judged = kind(p, event)
    return machine.run_step(
        TRANSITIONS, _phase, p, event, now, kind_of=lambda _: judged, error=InvalidTransition
    )


# ---------------------------------------------------------------- fleet ----


@dataclass(frozen=True, slots=True)
class Fleet:
    pods: Mapping[str, Pod]


def listed(
    f: Fleet, listings: Sequence[Listing], now: float, grace_s: float = 0.0
) -> tuple[Fleet, list[Action]]:
    """The endpoint list changed: new pods join (heard from before they take
    anything); a pod that left, or whose address changed, is dead; one listed
    as terminating is LEAVING, with ``grace_s`` for what it has."""
    want = {li.name: li for li in listings}
    pods: dict[str, Pod] = {}
    actions: list[Action] = []
    for name, p in f.pods.items():
        li = want.get(name)
        if li is not None and li.address == p.listing.address:
            pods[name] = replace(p, listing=li)
        elif p.phase is not Phase.DEAD:
            actions.append(Dead(name, "removed"))
    for name, li in want.items():
        if name not in pods:
            old = f.pods.get(name)
            # Back at another address: a new generation all the same.
            pods[name] = Pod(li, generation=old.generation + 1 if old else 1)
        if li.terminating:
            pods[name], done = step(pods[name], Terminating(name, now + grace_s), now)
            actions += done
    return Fleet(pods), actions


def feed(f: Fleet, event: Event, now: float) -> tuple[Fleet, list[Action]]:
    """Apply ``event`` to its pod; an event for a pod no longer listed is moot."""
    p = f.pods.get(event.name)
    if p is None:
        return f, []
    new, actions = step(p, event, now)
    return Fleet({**f.pods, p.name: new}), actions


def silent(f: Fleet, w: Watchdog, due: float, now: float) -> list[Silent]:
    """The pods whose probes went unanswered past ``w.hang_after_s``, judged
    at ``now`` by a check due at ``due`` (a late check judges nothing)."""
    out = []
    for p in f.pods.values():
        if p.phase in (Phase.READY, Phase.UNREADY, Phase.LEAVING):
            judged = judge_beat(w, due, now, p.heard_at)
            if judged.beat is Beat.HUNG:
                out.append(Silent(p.name, judged.silent_s))
    return out


def overdue(f: Fleet, now: float) -> list[Overdue]:
    """The LEAVING pods whose grace is over."""
    return [
        Overdue(p.name)
        for p in f.pods.values()
        if p.phase is Phase.LEAVING and p.leave_by is not None and now >= p.leave_by
    ]


def pick(f: Fleet, busy: Callable[[str], int], turn: int) -> Pod | None:
    """The ready pod with the fewest requests in flight; ties taken in turn
    (``turn`` rises with each pick), so that an idle fleet shares the load."""
    ready = sorted(p.name for p in f.pods.values() if p.phase is Phase.READY)
    if not ready:
        return None
    n = len(ready)
    best = min(range(n), key=lambda i: (busy(ready[i]), (i - turn) % n))
    return f.pods[ready[best]]


def routable(f: Fleet) -> int:
    return sum(p.phase is Phase.READY for p in f.pods.values())


def stream_silent(w: Watchdog, due: float, now: float, quiet_since: float | None) -> bool:
    """Whether a pod's quietest open stream, last heard at ``quiet_since``
    (None: no stream open), is silent past the deadline: its front writes a
    heartbeat on it every ``wire.serving.BEAT_INTERVAL_S``, so silence is the
    pod's, not the model's."""
    return judge_beat(w, due, now, quiet_since).beat is Beat.HUNG
