"""The gateway's API keys: optional Bearer keys, as vLLM's ``--api-key``.

Keys come from ``--api-key-file`` (one per line: a mounted Secret, which the
kubelet updates in place, so the file is looked at again every
``RECHECK_S``) or ``--api-key`` (visible in ``/proc``: the file is the
production way). Only their SHA-256 digests are kept, and a request's key is
compared with every one of them by ``hmac.compare_digest`` on digests of one
length, so the time an answer takes tells nothing of how much of a key was
right, or which. A key is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from understudy.wire.obs import log_event

log = logging.getLogger("understudy.front")

RECHECK_S = 1.0  # how often the key file's change time is looked at
_BEARER = b"bearer "


class ApiKeyError(ValueError):
    """The keys given cannot be used (no file, no key in it)."""


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's ``Authorization: Bearer`` header, if any."""
    for name, value in headers:
        if name.lower() == b"authorization":
            given = value.strip()
            if given[: len(_BEARER)].lower() == _BEARER:
                return given[len(_BEARER) :].strip() or None
            return None
    return None


def matches(token: bytes | None, digests: frozenset[bytes]) -> bool:
    """Whether ``token`` is one of the keys, compared with all of them."""
    if token is None:
        return False
    mine, ok = digest(token), False
    for d in digests:
        ok |= hmac.compare_digest(d, mine)
    return ok


def parse(text: bytes) -> frozenset[bytes]:
    """A key file's digests: one key per line, blank lines and the space
    around a key ignored (a Secret's value often ends in a newline)."""
    return frozenset(digest(line.strip()) for line in text.splitlines() if line.strip())


class ApiKeys:
    """The keys a request must show one of; re-read when the file changes."""

    def __init__(
        self,
        path: Path | None = None,
        keys: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._given = frozenset(digest(k.strip().encode()) for k in keys if k.strip())
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._checked = clock()
        self._from_file: frozenset[bytes] = frozenset()
        if path is not None:
            try:
                self._read()
            except OSError as exc:
                raise ApiKeyError(f"cannot read the API key file {path}: {exc.strerror}") from None
            if not self._from_file:
                raise ApiKeyError(f"the API key file {path} holds no key")

    def _read(self) -> None:
        assert self.path is not None
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        keys = parse(self.path.read_bytes())
        self._stamp = stamp
        if not keys:
            # A Secret being rewritten, or emptied by mistake: nobody would
            # get in. Keep the keys that worked.
            log_event(log, "api_keys_empty_kept_last", logging.WARNING, path=str(self.path))
            return
        if keys != self._from_file and self._from_file:
            log_event(log, "api_keys_reloaded", count=len(keys))
        self._from_file = keys

    def _fresh(self) -> frozenset[bytes]:
        now = self._clock()
        if self.path is not None and now - self._checked >= RECHECK_S:
            self._checked = now
            try:
                self._read()
            except OSError as exc:
                log_event(
                    log, "api_keys_unreadable_kept_last", logging.WARNING,
                    path=str(self.path), error=exc.strerror,
                )  # fmt: skip
        return self._given | self._from_file

    def allows(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        return matches(bearer(headers), self._fresh())
