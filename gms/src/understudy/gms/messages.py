"""Every GMS wire shape: the only module that defines one (one vocabulary).

Client → server requests and server → client replies are pydantic v2 frozen
models, ``extra="forbid"``, discriminated on ``type``. Frames are the 4-byte
length prefix of ``understudy.wire.framing``; an exported allocation travels
as one fd (SCM_RIGHTS) in the same ``sendmsg`` as its ``exported`` reply.

One request, one reply, in order, per connection. A ``hello`` is answered
only when the lock is granted or its timeout expires.

Re-adoption (after GMS restarted): an engine that still maps a committed
layout says ``hello`` with mode ``ADOPT`` and that layout's hash, then sends
each allocation back as ``adopt_allocation`` carrying its fd, the metadata,
and ``commit``. This is the one request a client sends an fd with; the server
takes none with any other request.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import pydantic

from understudy.wire.messages import FROZEN, MessageCodec

# Requests are small (the largest is one metadata record). Replies can list
# thousands of allocations and metadata records, so the client accepts more.
MAX_REQUEST_FRAME = 1024 * 1024
MAX_REPLY_FRAME = 64 * 1024 * 1024
MAX_TIMEOUT_S = 24 * 3600.0
MAX_EXPORT_BATCH = 1024  # fds in flight per request (the kernel caps them per user)


class GmsError(Exception):
    """Base of every GMS error, protocol and client alike."""


class LocalGmsError(GmsError):
    """We broke the protocol's rules (a bug on this side)."""


class RemoteGmsError(GmsError):
    """The peer sent something that breaks the protocol: reply, then close."""


class Mode(enum.StrEnum):
    """What a client asks for in ``hello``."""

    RW = "RW"
    RO = "RO"
    RW_OR_RO = "RW_OR_RO"
    # Re-export a layout this client still maps (GMS restarted under it).
    ADOPT = "ADOPT"


class Granted(enum.StrEnum):
    """What a session holds."""

    RW = "RW"
    RO = "RO"
    ADOPT = "ADOPT"  # re-exporting its layout; RO once committed


class LockState(enum.StrEnum):
    """The lock state, derived from live sessions."""

    EMPTY = "EMPTY"  # nothing committed, no writer
    RW = "RW"  # a writer holds the lock
    COMMITTED = "COMMITTED"  # committed, no sessions
    RO = "RO"  # committed, one or more readers
    # GMS restarted after a commit: the layout lives on in an engine's
    # mappings, and is waited for (re-adoption) within a window.
    ORPHANED = "ORPHANED"


class ErrorCode(enum.StrEnum):
    TIMEOUT = "timeout"  # the lock was not granted within the hello's timeout
    REFUSED = "refused"  # not allowed in this session (e.g. allocate while RO)
    NOT_FOUND = "not_found"  # unknown allocation id or metadata key
    INVALID = "invalid"  # a well-formed request with a bad argument
    NO_MEMORY = "no_memory"  # the backend could not create the allocation
    STALE_EPOCH = "stale_epoch"  # a writer whose lock epoch is older than one GMS has seen
    STALE_LAYOUT = "stale_layout"  # an adopter's layout is not the one GMS has or awaits
    PROTOCOL = "protocol"  # undecodable input; the server closes the connection


Tag = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=64, pattern=r"^[\w.-]+$")]
MetaKey = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=512)]
AllocId = Annotated[int, pydantic.Field(ge=0)]


class _Msg(pydantic.BaseModel):
    model_config = FROZEN


# --- requests -----------------------------------------------------------------


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    mode: Mode
    timeout_s: Annotated[float, pydantic.Field(ge=0, le=MAX_TIMEOUT_S)]
    client: Annotated[str, pydantic.StringConstraints(max_length=128)] = ""
    # The pod lock's epoch the engine holds, once it holds one: GMS refuses to
    # let an engine write whose epoch is older than the newest it has seen (a
    # fencing token; engines that hold no lock yet send none).
    epoch: Annotated[int, pydantic.Field(ge=0, le=2**53 - 1)] | None = None
    # ADOPT only: the hash of the layout the client maps and will re-export.
    layout_hash: Annotated[str, pydantic.StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None

    @pydantic.model_validator(mode="after")
    def _adopt_names_its_layout(self) -> Hello:
        if (self.mode is Mode.ADOPT) != (self.layout_hash is not None):
            raise ValueError("layout_hash goes with mode ADOPT, and only with it")
        return self


class Allocate(_Msg):
    type: Literal["allocate"] = "allocate"
    size: Annotated[int, pydantic.Field(gt=0, le=1 << 48)]
    tag: Tag = "weights"


class AdoptAllocation(_Msg):
    """One allocation of the adopted layout, in the layout's order, carrying
    the memory itself: exactly one fd (SCM_RIGHTS) in the same sendmsg."""

    type: Literal["adopt_allocation"] = "adopt_allocation"
    size: Annotated[int, pydantic.Field(gt=0, le=1 << 48)]  # as first requested
    tag: Tag = "weights"


class Export(_Msg):
    type: Literal["export"] = "export"
    id: AllocId


class ExportMany(_Msg):
    """Answered by one ``exported`` reply (and fd) per id, in order, or by one
    error if any id is unknown. Saves a request per allocation on wake."""

    type: Literal["export_many"] = "export_many"
    ids: Annotated[tuple[AllocId, ...], pydantic.Field(min_length=1, max_length=MAX_EXPORT_BATCH)]


class ListAllocations(_Msg):
    type: Literal["list_allocations"] = "list_allocations"


class PutMetadata(_Msg):
    type: Literal["put_metadata"] = "put_metadata"
    key: MetaKey
    value: dict[str, pydantic.JsonValue]


class GetMetadata(_Msg):
    type: Literal["get_metadata"] = "get_metadata"
    key: MetaKey


class ListMetadata(_Msg):
    type: Literal["list_metadata"] = "list_metadata"


class Commit(_Msg):
    type: Literal["commit"] = "commit"


class GetLayoutHash(_Msg):
    type: Literal["get_layout_hash"] = "get_layout_hash"


class GetState(_Msg):
    type: Literal["get_state"] = "get_state"


class KvAcquire(_Msg):
    """Map the device's KV pool read-write (docs/kv-pool.md).

    Only the pod lock's holder may, under the epoch it was granted: GMS checks
    ``epoch`` and ``client`` against the lock server's record. The pool is
    one allocation (tag ``kv``) that outlives its holders: it is created the
    first time (zeroed), handed on as it is after the holder's connection
    ends, and replaced only when an engine asks for another ``size`` or
    ``spec``. Answered by ``kv_granted`` with the pool's fd, or an error.
    """

    type: Literal["kv_acquire"] = "kv_acquire"
    epoch: Annotated[int, pydantic.Field(ge=0, le=2**53 - 1)]
    size: Annotated[int, pydantic.Field(gt=0, le=1 << 48)]
    # What the pool holds, in the engine's words (its layout's digest): a pool
    # made for another model or geometry is replaced, never handed on.
    spec: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=256)]
    timeout_s: Annotated[float, pydantic.Field(ge=0, le=MAX_TIMEOUT_S)]
    client: Annotated[str, pydantic.StringConstraints(max_length=128)] = ""


class KvPeek(_Msg):
    """Map the device's KV pool read-only, as it is, for as long as the session
    lasts (docs/kv-pool.md#a-standbys-read-only-view).

    For a standby: its pages mapped before it holds the lock, so that its
    first reads after a failover take no page faults. Any session may ask;
    the kernel refuses it a writable mapping (the fd is read-only), so the
    writer stays the lock's holder alone. The pool must exist with this
    ``size`` and ``spec``, else ``not_found``: nobody has created it yet, or
    it is another engine's. Answered by ``kv_granted`` (``writable`` false).
    """

    type: Literal["kv_peek"] = "kv_peek"
    size: Annotated[int, pydantic.Field(gt=0, le=1 << 48)]
    spec: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=256)]
    client: Annotated[str, pydantic.StringConstraints(max_length=128)] = ""


Request = Annotated[
    Hello
    | Allocate
    | AdoptAllocation
    | Export
    | ExportMany
    | ListAllocations
    | PutMetadata
    | GetMetadata
    | ListMetadata
    | Commit
    | GetLayoutHash
    | GetState
    | KvAcquire
    | KvPeek,
    pydantic.Field(discriminator="type"),
]

# --- replies ------------------------------------------------------------------


class AllocationInfo(_Msg):
    id: AllocId
    size: int  # aligned to the backend's granularity
    requested: int
    tag: str


class HelloOk(_Msg):
    type: Literal["hello_ok"] = "hello_ok"
    granted: Granted
    layout_hash: str | None  # the committed layout when granted RO
    granularity: int
    backend: str
    device: int


class Allocated(_Msg):
    type: Literal["allocated"] = "allocated"
    allocation: AllocationInfo


class Exported(_Msg):
    """Carries exactly one fd (SCM_RIGHTS) in the same sendmsg."""

    type: Literal["exported"] = "exported"
    allocation: AllocationInfo


class Allocations(_Msg):
    type: Literal["allocations"] = "allocations"
    allocations: tuple[AllocationInfo, ...]


class MetadataValue(_Msg):
    type: Literal["metadata"] = "metadata"
    key: str
    value: dict[str, pydantic.JsonValue]


class MetadataList(_Msg):
    type: Literal["metadata_list"] = "metadata_list"
    items: dict[str, dict[str, pydantic.JsonValue]]


class Ok(_Msg):
    type: Literal["ok"] = "ok"


class Committed(_Msg):
    type: Literal["committed"] = "committed"
    layout_hash: str


class LayoutHash(_Msg):
    type: Literal["layout_hash"] = "layout_hash"
    committed: bool
    layout_hash: str | None


class DeviceReport(_Msg):
    """The GPU behind a server, from NVML (absent where there is no NVML)."""

    uuid: str
    name: str
    memory_total: int  # bytes on the device
    memory_used: int  # in use by every process, not only GMS
    healthy: bool
    reason: str  # why not healthy; "" when healthy


class KvGranted(_Msg):
    """Carries the pool's fd (SCM_RIGHTS) in the same sendmsg: writable for
    ``kv_acquire``, read-only for ``kv_peek``."""

    type: Literal["kv_granted"] = "kv_granted"
    allocation: AllocationInfo
    created: bool  # fresh zeroed memory; False: the pool as its last holder left it
    previous_epoch: int | None  # the epoch that held it last (None: created now)
    granularity: int
    backend: str
    device: int
    writable: bool = True


class KvReport(_Msg):
    """The KV pool in a state report."""

    bytes: int
    spec: str
    holder_epoch: int | None  # None: nobody maps it now
    last_epoch: int  # the epoch of its last grant
    grants: int  # how many times it was granted
    readers: int = 0  # sessions that map it read-only (kv_peek): standbys


class StateReport(_Msg):
    type: Literal["state"] = "state"
    state: LockState
    committed: bool
    sessions: dict[Granted, int]
    waiting: int
    waiting_writers: int
    allocations: int
    bytes: int
    layout_hash: str | None
    device: int
    tag: str
    backend: str
    gpu: DeviceReport | None = None  # filled in by the server's shell (health.py)
    kv: KvReport | None = None  # the KV pool, if one was created


class ErrorReply(_Msg):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str


Reply = Annotated[
    HelloOk
    | Allocated
    | Exported
    | Allocations
    | MetadataValue
    | MetadataList
    | Ok
    | Committed
    | LayoutHash
    | StateReport
    | KvGranted
    | ErrorReply,
    pydantic.Field(discriminator="type"),
]

REQUEST_ADAPTER: pydantic.TypeAdapter[Request] = pydantic.TypeAdapter(Request)
REPLY_ADAPTER: pydantic.TypeAdapter[Reply] = pydantic.TypeAdapter(Reply)


def request_codec() -> MessageCodec[Request]:
    """What the server feeds received bytes into."""
    return MessageCodec(REQUEST_ADAPTER, RemoteGmsError, MAX_REQUEST_FRAME)


def reply_codec() -> MessageCodec[Reply]:
    """What the client parses reply bodies with."""
    return MessageCodec(REPLY_ADAPTER, RemoteGmsError, MAX_REPLY_FRAME)


def socket_name(device: int, tag: str = "weights") -> str:
    """``gms_<device>_<tag>.sock`` (docs/pod.md)."""
    return f"gms_{device}_{tag}.sock"
