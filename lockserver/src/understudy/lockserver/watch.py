"""Watching the lock's holder from asyncio: what the pod's front door uses.

``watch(address)`` connects, subscribes and yields a ``Holder`` now and at
every change (grant, release, window). It ends with ``LockUnavailable`` when
the server goes away; the caller reconnects (a restarted server answers with
the holder it restored, and its window says whether that holder is back).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from understudy.lockserver.client import Address, LockRefused, LockUnavailable
from understudy.lockserver.messages import Error, Holder, Watch, client_codec, server_codec


async def watch(
    address: Address, connect_timeout: float = 1.0, token: str | None = None
) -> AsyncIterator[Holder]:
    try:
        async with asyncio.timeout(connect_timeout):
            if address.tcp is not None:
                reader, writer = await asyncio.open_connection(*address.tcp)
            else:
                reader, writer = await asyncio.open_unix_connection(str(address.path))
    except (OSError, TimeoutError) as exc:
        raise LockUnavailable(f"cannot reach the lock server at {address}: {exc}") from None
    codec = server_codec()
    try:
        writer.write(client_codec().encode(Watch(token=token)))
        await writer.drain()
        while True:
            data = await reader.read(64 * 1024)
            if not data:
                raise LockUnavailable(f"the lock server at {address} closed the watch")
            for message in codec.feed(data):
                match message:
                    case Holder():
                        yield message
                    case Error(code=code, message=text):
                        raise LockRefused(code, text)
                    case _:
                        raise LockUnavailable(f"unexpected {message.type} on a watch")
    except ConnectionError as exc:
        raise LockUnavailable(f"the lock server at {address} went away: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
