"""A drill's next round waits for the fronts' poison isolation to be open."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from understudy.tools.drill_target import isolation_open


class _Fronts:
    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def front_status_urls(self) -> list[str]:
        return self.urls


@pytest.fixture
def front() -> Iterator[tuple[str, dict[str, str]]]:
    state = {"isolation": "open"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"pid": 1, **state}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_open_only_while_no_suspect_waits_to_run_alone(front: tuple[str, dict[str, str]]) -> None:
    url, state = front
    assert isolation_open(_Fronts([url]))
    state["isolation"] = "clearing"
    assert not isolation_open(_Fronts([url]))
    state["isolation"] = "alone"
    assert not isolation_open(_Fronts([url]))


def test_a_front_out_of_reach_is_not_known_open_and_a_target_without_fronts_is() -> None:
    assert not isolation_open(_Fronts(["http://127.0.0.1:1"]))
    assert isolation_open(object())
