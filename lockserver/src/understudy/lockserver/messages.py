"""Every message of the lock protocol, and its codec (the only wire shapes).

Client → server: ``Acquire`` (blocks until ``Granted``), ``Status``, ``Watch``.
Server → client: ``Granted``, ``StatusReply``, ``Holder``, ``Error``.
There is no release message: closing the connection releases, so only a
holder's death (or its own hang-up) can free the lock.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from understudy.wire.messages import FROZEN, MessageCodec

MAX_FRAME = 16 * 1024
MAX_ID = 256
# Epochs stay exact in the JSON state file (a double holds integers up to
# 2**53); the core has the same bound (a test checks they agree).
MAX_EPOCH = 2**53 - 1


class LockProtocolError(Exception):
    """Base of lock protocol errors."""


class RemoteLockProtocolError(LockProtocolError):
    """The peer broke the protocol: reply with an error and close."""


EngineId = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=MAX_ID)]
Token = Annotated[str, pydantic.StringConstraints(max_length=1024)]


class Acquire(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["acquire"] = "acquire"
    engine_id: EngineId
    # Set when a holder that lost its connection (say, the server restarted)
    # tries to get the same grant back: re-granted with this epoch only if
    # nobody else was granted in between, otherwise refused as superseded.
    resume_epoch: int | None = pydantic.Field(default=None, ge=0, le=MAX_EPOCH)
    token: Token | None = None


class Status(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["status"] = "status"
    token: Token | None = None


class Watch(pydantic.BaseModel):
    """Subscribe to the lock's holder: one ``Holder`` now, then one per change.

    The pod's front door routes by it: a release is seen the instant the
    holder's connection closes, and a grant names the engine and its epoch."""

    model_config = FROZEN
    type: Literal["watch"] = "watch"
    token: Token | None = None


class Granted(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["granted"] = "granted"
    engine_id: str
    epoch: int
    resumed: bool = False
    # The server had lost its record: a resume claim it honoured under a new
    # epoch. The holder keeps the lock and fences with the new epoch.
    reissued: bool = False
    # Wall time (Unix seconds) the previous holder's connection closed, when
    # this grant follows it: the new engine and the operator measure a
    # failover from the old engine's death, detection included.
    released_at: float | None = None


class StatusReply(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["status_reply"] = "status_reply"
    holder: str | None
    epoch: int
    waiters: tuple[str, ...]
    window_open: bool
    window_holder: str | None
    window_remaining_s: float | None


class Holder(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["holder"] = "holder"
    holder: str | None  # engine id; None while nobody holds the lock
    epoch: int
    window_open: bool


ErrorCode = Literal["bad_request", "unauthorized", "superseded", "busy", "internal"]


class Error(pydantic.BaseModel):
    model_config = FROZEN
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str


ClientMessage = Annotated[Acquire | Status | Watch, pydantic.Field(discriminator="type")]
ServerMessage = Annotated[
    Granted | StatusReply | Holder | Error, pydantic.Field(discriminator="type")
]

CLIENT_ADAPTER: pydantic.TypeAdapter[Acquire | Status | Watch] = pydantic.TypeAdapter(ClientMessage)
SERVER_ADAPTER: pydantic.TypeAdapter[Granted | StatusReply | Holder | Error] = pydantic.TypeAdapter(
    ServerMessage
)


def client_codec() -> MessageCodec[Acquire | Status | Watch]:
    """What a server uses to read clients."""
    return MessageCodec(CLIENT_ADAPTER, RemoteLockProtocolError, MAX_FRAME)


def server_codec() -> MessageCodec[Granted | StatusReply | Holder | Error]:
    """What a client uses to read the server."""
    return MessageCodec(SERVER_ADAPTER, RemoteLockProtocolError, MAX_FRAME)
