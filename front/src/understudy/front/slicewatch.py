"""The gateway's pod list on Kubernetes: a Service's EndpointSlices, listed
then watched (``understudy gateway --endpointslices NAMESPACE/SERVICE``).

Shell module. A thread runs the ``kubernetes`` client, which blocks: it
lists the slices labelled ``kubernetes.io/service-name=SERVICE`` in
NAMESPACE, then watches them from the list's ``resourceVersion``, and after
every change that moves the pod list hands the whole list
(``pods.listings_from_slices``, the pure part) to the event loop with
``loop.call_soon_threadsafe(deliver, listings)``; ``deliver`` is the
router's ``list_pods``, which runs on the loop as every other event does.

- A watch that ends (its ``timeoutSeconds``) resumes from the last
  ``resourceVersion`` it saw (an event's, or a bookmark's).
- ``410 Gone`` (that version is too old) lists again at once.
- Any other error (the API server unreachable, refusing, a broken stream)
  backs off, from ``backoff_s[0]`` doubling to ``backoff_s[1]``, then lists
  again.

An error never hands over a list, empty or not: while the API server cannot
be reached the gateway routes on its last known pods, and its own probes of
each front still say which of them serve, which die and which come back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from understudy.front import pods
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.gateway.endpointslices")

Deliver = Callable[[list[pods.Listing]], None]

# The API server ends a watch after this long; the thread resumes it.
WATCH_TIMEOUT_S = 240
# A stream silent past its timeout plus this is a broken one (a partition).
_READ_SLACK_S = 30
_LIST_TIMEOUT_S = 10.0
_GONE = 410


class SliceWatch:
    """List and watch one Service's EndpointSlices in a thread; deliver each
    new pod list to the loop."""

    def __init__(
        self,
        namespace: str,
        service: str,
        deliver: Deliver,
        loop: asyncio.AbstractEventLoop,
        *,
        api_client: Any = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        backoff_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.selector = f"kubernetes.io/service-name={service}"
        self._deliver = deliver
        self._loop = loop
        self._api_client = api_client
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._slices: dict[str, Mapping[str, Any]] = {}
        self._delivered: list[pods.Listing] | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        # What the thread did, for the tests and the log: lists, watches begun,
        # errors, 410s.
        self.counts = {"lists": 0, "watches": 0, "errors": 0, "gone": 0}

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"endpointslices-{self.service}", daemon=True
        )
        self._thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """Stop at the thread's next wake (a daemon: nothing waits for it
        unless ``join_s``)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None and join_s > 0:
            self._thread.join(join_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ thread --

    def _run(self) -> None:
        from kubernetes.client import DiscoveryV1Api
        from kubernetes.client.exceptions import ApiException

        api = DiscoveryV1Api(self._api_client or in_cluster_client())
        delay = self._backoff_s[0]
        while not self._stop.is_set():
            try:
                version = self._list(api)
                delay = self._backoff_s[0]
                while not self._stop.is_set():
                    version = self._watch_from(api, version)
            except ApiException as exc:
                if exc.status == _GONE:
                    self.counts["gone"] += 1
                    log_event(log, "endpointslices_gone", service=self.service)
                    continue  # list again at once
                delay = self._failed(exc, delay)
            except Exception as exc:  # unreachable, reset, a stream cut short
                delay = self._failed(exc, delay)

    def _failed(self, exc: BaseException, delay: float) -> float:
        self.counts["errors"] += 1
        log_event(
            log, "endpointslices_unavailable", logging.WARNING, service=self.service,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            retry_s=delay, pods_kept=len(self._delivered or ()),
        )  # fmt: skip
        self._stop.wait(delay)
        return min(delay * 2, self._backoff_s[1])

    def _list(self, api: Any) -> str:
        resp = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=_LIST_TIMEOUT_S,
        )
        doc = json.loads(resp.data)
        self.counts["lists"] += 1
        self._slices = {
            str(sl["metadata"]["name"]): sl for sl in doc.get("items") or () if _named(sl)
        }
        self._publish()
        return str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_from(self, api: Any, version: str) -> str:
        """One watch until it ends; the last resourceVersion it saw."""
        from kubernetes import watch

        w = watch.Watch()  # type: ignore[no-untyped-call]
        self._watch = w
        self.counts["watches"] += 1
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self.selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=self._watch_timeout_s + _READ_SLACK_S,
            ):
                if self._stop.is_set():
                    break
                obj = event.get("raw_object") or {}
                meta = obj.get("metadata") or {}
                version = str(meta.get("resourceVersion") or version)
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED") and _named(obj):
                    self._slices[str(meta["name"])] = obj
                elif kind == "DELETED":
                    self._slices.pop(str(meta.get("name")), None)
                else:
                    continue  # a bookmark: only its version
                self._publish()
        finally:
            self._watch = None
        return version

    def _publish(self) -> None:
        listings, skipped = pods.listings_from_slices(list(self._slices.values()))
        if listings == self._delivered:
            return
        self._delivered = listings
        for s in skipped:
            log_event(log, "endpoint_skipped", endpoint=s.endpoint, reason=s.reason)
        try:
            self._loop.call_soon_threadsafe(self._deliver, list(listings))
        except RuntimeError:  # the loop is closed: the gateway is gone
            self._stop.set()


def _named(obj: Mapping[str, Any]) -> bool:
    return isinstance((obj.get("metadata") or {}).get("name"), str)


def in_cluster_client() -> Any:
    """An API client from the pod's ServiceAccount, else from the kubeconfig."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return client.ApiClient(configuration)


def parse_target(text: str) -> tuple[str, str]:
    """``NAMESPACE/SERVICE``, each a DNS label."""
    namespace, sep, service = text.partition("/")
    if not sep or not _label(namespace) or not _label(service):
        raise ValueError(f"{text!r}: --endpointslices is NAMESPACE/SERVICE")
    return namespace, service


def _label(text: str) -> bool:
    return (
        0 < len(text) <= 63
        and text[0].isalnum()
        and text[-1].isalnum()
        and all(c.isdigit() or ("a" <= c <= "z") or c == "-" for c in text)
    )
